"""What identifies a model's weights by content, so that a checkpoint replaced at the same path is
noticed: recorded as the results attr ``model_sha256``, part of every resume fingerprint, and
compared by every join of results files (:mod:`truncsens.results.join`).

- A local checkpoint folder (the bundled reference model included): the SHA-256 of its
  configuration, tokenizer and weight files (:data:`CHECKPOINT_FILES`), each entered with its name
  and size and then its bytes, in name order (:func:`checkpoint_sha256`). Weights are read once in
  1 MiB blocks (about a second per GB); safetensors headers alone would not do, since two checkpoints
  of one architecture have equal headers.
- A model passed in memory: the SHA-256 of its state dict, every tensor entered with its name,
  dtype and shape and then its bytes (:func:`state_sha256`).
- A hub model: its commit (``model_revision``) identifies it; ``model_sha256`` is then empty.
- A synthetic source: its spec identifies it; ``model_sha256`` is empty.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.model", "*.txt", "*.tiktoken")
SKIPPED_FILES = ("README.md", "train_log.csv", "eval.json", "training_summary.json")  # a card, not the model
BLOCK = 1 << 20


def checkpoint_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that decide the model (config, tokenizer, weights), sorted by name.
    The model card and training records beside the bundled reference model are left out."""
    found = {p for pattern in CHECKPOINT_FILES for p in folder.glob(pattern) if p.is_file()}
    return sorted((p for p in found if p.name not in SKIPPED_FILES), key=lambda p: p.name)


def checkpoint_sha256(folder: str | Path) -> str:
    """SHA-256 (hex) of a checkpoint folder's model files (:func:`checkpoint_files`), each as
    ``name``, NUL, size in decimal, NUL, then its bytes.

    Raises:
        OSError: a file cannot be read.
    """
    h = hashlib.sha256()
    for path in checkpoint_files(Path(folder)):
        h.update(path.name.encode("utf-8", "surrogatepass") + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                h.update(block)
    return h.hexdigest()


def state_sha256(model) -> str:
    """SHA-256 (hex) of a torch module's state dict: per tensor, in the state dict's order, its name,
    dtype and shape, then its bytes (copied to the CPU one tensor at a time)."""
    import torch

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode("utf-8", "surrogatepass"))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
