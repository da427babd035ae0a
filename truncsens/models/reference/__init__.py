"""The bundled reference model: weights, tokenizer and model card (``weights/``) and its trainer."""
