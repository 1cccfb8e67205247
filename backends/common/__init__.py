"""What both backends share that names no framework: the attention metadata a model reads, the
rotary tables, and the checkpoint's weights under canonical names."""
