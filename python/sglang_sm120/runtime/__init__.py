"""One TP group's sm120 backend: gate agreement, workspace build, dispatch and counters. Knows nothing of SGLang's
modules; the hooks hand it a group object and call it."""
