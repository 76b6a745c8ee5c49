"""What tests share: CPU stand-ins of the kernel workspace and of SGLang's group coordinator."""
