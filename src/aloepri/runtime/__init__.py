"""Running a model in process: the plaintext tokenizer, private inference, fidelity metrics (layer 3)."""
