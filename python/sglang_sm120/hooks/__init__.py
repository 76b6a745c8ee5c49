"""Everything that names SGLang: the replacements the seam tables install, one module per SGLang concern."""
