"""Where models come from: the architectures both backends build (architectures.py), GGUF files
dequantized into checkpoint directories (gguf.py), tokenizers and their EOS ids (tokenizer.py),
and the models shipped or installed with the package (demo.py)."""
