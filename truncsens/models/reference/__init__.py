"""The bundled reference model: weights, tokenizer and model card (``weights/``) and its trainer.

May import: models, corpora and the math modules (its held-out evaluation runs through truncsens.api.reference).
"""
