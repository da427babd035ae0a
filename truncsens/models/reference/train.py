"""Train the bundled reference model: a small Llama (RoPE, RMSNorm, SwiGLU) with a byte-level BPE
tokenizer, on the training split of the builtin ``code`` and ``nl`` corpora.

Run with ``truncsens train-reference`` (or ``python -m truncsens.models.reference.train``). The result is
a Hugging Face checkpoint folder (``config.json``, ``model.safetensors``, ``tokenizer.json``) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load like any hub model. Training is seeded; on 2 CPU
cores it runs for hours, so it is never part of the test suite.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from truncsens.corpora.builtin import code_documents, nl_documents
from truncsens.corpora.document import Document, select_split

EOS = "<|endoftext|>"


@dataclass
class TrainConfig:
    """Configuration of one reference-model training run (sizes in tokens unless stated)."""

    out_dir: str = "runs/reference"
    vocab_size: int = 4096
    hidden_size: int = 320
    intermediate_size: int = 864
    num_layers: int = 5
    num_heads: int = 5
    context: int = 1024
    batch_size: int = 8
    max_steps: int = 3000
    max_minutes: float = 120.0
    lr: float = 3e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_sequences: int = 48
    seed: int = 0
    bf16_autocast: bool = True
    threads: int = 0  # 0: torch default


def train_tokenizer(docs: list[Document], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE tokenizer on the documents and save it as a HF tokenizer folder."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        (d.text for d in docs), vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS, unk_token=None,
        model_max_length=1_000_000,
    )
    tok.save_pretrained(str(out_dir))
    return tok


def _stream(docs: list[Document], tok) -> torch.Tensor:
    ids: list[int] = []
    for d in docs:
        ids.extend(tok(d.text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _lr_at(step: int, cfg: TrainConfig, minutes: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` over steps or wall time, whichever ends first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    by_steps = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, max(by_steps, minutes / cfg.max_minutes))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def positional_nll(model, sequences: torch.Tensor, bins: list[tuple[int, int]]) -> list[float]:
    """Mean next-token NLL (nats) of ``sequences`` [n, L+1] in position bins [lo, hi) of the target."""
    model.eval()
    x, y = sequences[:, :-1], sequences[:, 1:]  # [n, L] each
    total = torch.zeros(y.shape[1])
    for i in range(0, x.shape[0], 8):
        logits = model(input_ids=x[i : i + 8]).logits.float()  # [b, L, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y[i : i + 8], reduction="none")
        total += nll.sum(0)
    mean = total / x.shape[0]
    model.train()
    return [mean[lo:hi].mean().item() for lo, hi in bins]


def _export(model, folder: Path) -> None:
    """Save the weights in bfloat16 (half the bytes; loaders upcast to the requested dtype)."""
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embedding; stored once
    model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)


def train(cfg: TrainConfig) -> Path:
    """Train tokenizer and model; write checkpoints and ``train_log.csv`` into ``cfg.out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))

    code, nl = code_documents(), nl_documents()
    train_docs = select_split(code, "train") + select_split(nl, "train")
    tok = train_tokenizer(train_docs, cfg.vocab_size, out / "final")
    data = _stream(train_docs, tok)  # [T]
    held = _stream(select_split(code, "heldout"), tok)  # [T_heldout]
    g = torch.Generator().manual_seed(cfg.seed + 1)
    L = cfg.context
    starts = torch.randint(0, held.numel() - L - 1, (cfg.eval_sequences,), generator=g)
    eval_seqs = torch.stack([held[s : s + L + 1] for s in starts.tolist()])  # [n, L+1]
    bins = [(8, 24), (56, 72), (248, 264), (L - 64, L)]
    print(f"train tokens {data.numel()}, heldout code tokens {held.numel()}", flush=True)

    mcfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, max_position_embeddings=L, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(mcfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    log = open(out / "train_log.csv", "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "tokens", "minutes", "lr", "train_loss", "nll_pos16", "nll_pos64", "nll_pos256", "nll_posmax"])
    t0 = time.time()
    step, tokens, running = 0, 0, None
    while step < cfg.max_steps and (time.time() - t0) / 60 < cfg.max_minutes:
        idx = torch.randint(0, data.numel() - L - 1, (cfg.batch_size,), generator=g)
        batch = torch.stack([data[s : s + L + 1] for s in idx.tolist()])  # [B, L+1]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg, (time.time() - t0) / 60)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        # labels are shifted inside the model; the last target of batch is unused (harmless)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += batch.numel()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
                nll = positional_nll(model, eval_seqs, bins)
            minutes = (time.time() - t0) / 60
            writer.writerow([step, tokens, f"{minutes:.2f}", f"{_lr_at(step, cfg, minutes):.2e}", f"{running:.4f}"] + [f"{v:.4f}" for v in nll])
            log.flush()
            print(f"step {step} tok {tokens} min {minutes:.1f} loss {running:.3f} nll@pos {['%.3f' % v for v in nll]} gain {nll[0]-nll[-1]:.3f}", flush=True)
            _export(model, out / "final")
    _export(model, out / "final")
    (out / "final" / "training_summary.json").write_text(json.dumps(
        {"parameters": n_params, "steps": step, "tokens_seen": tokens,
         "minutes": (time.time() - t0) / 60, "config": asdict(cfg)}, indent=2))
    log.close()
    return out / "final"


if __name__ == "__main__":
    import sys

    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
    base = TrainConfig()
    kwargs = {k: type(getattr(base, k))(v) if not isinstance(getattr(base, k), bool) else v.lower() in ("1", "true") for k, v in overrides.items()}
    train(TrainConfig(**kwargs))
