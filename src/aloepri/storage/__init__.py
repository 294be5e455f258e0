"""Files on disk: atomic staging of outputs, the safetensors-directory reader, model sources (layer 0)."""
