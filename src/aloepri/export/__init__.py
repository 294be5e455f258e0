"""Export of an obfuscated model directory to other formats: GGUF for llama.cpp (layer 3)."""
