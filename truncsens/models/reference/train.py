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
from truncsens.models.reference.data import DENSE_NAME_WORDS, DataMix
from truncsens.models.reference.start import FLOOR_LR, TrainError, earlier_stages, init_folder, load_start, main_stage, start_from

EOS = "<|endoftext|>"


@dataclass
class TrainConfig:
    """Configuration of one reference-model training run (sizes in tokens unless stated).

    The recipe is every field but ``out_dir``, ``max_minutes``, ``stop_at_step``, ``threads`` and
    ``stage_name`` (a label for the card): a resumed run must
    have the same recipe as the checkpoint it continues, as far as the steps that checkpoint has done
    go (:class:`TrainError` otherwise; a checkpoint of the main stage continues into any recall stage with the same ``min_lr``, the
    floor of both stages).

    Two stages: the main stage (steps ``0 .. max_steps - 1``) draws batches with ``repeat_share`` and
    ``kv_share``; the recall stage (the next ``recall_steps`` steps) draws them with
    ``recall_repeat_share`` and ``recall_kv_share`` in the dense key–value format
    (:func:`truncsens.models.reference.data.kv_dense_text`), its learning rate warmed up again to
    ``recall_lr`` and decayed to ``min_lr``; its first ``recall_warm_steps`` steps use
    ``recall_warm_context``-token crops (more of them per step), where recall is learnt at short
    distances first, as in the main stage's warm phase. The main stage alone (2,000 steps) left the
    model at chance on key–value recall. The installed model adds three recall stages, each trained
    from the exported weights of the one before (``init_from``): 800 steps of dense recall (warm
    crops of 256 tokens doubling in 3 phases over 600 steps, names from 20 words), then 1,000 and
    600 steps with induction sequences (``recall_induction_share``); the defaults below keep the fields' earlier values,
    which checkpoints written before a field existed ran with (docs/reference-model.md).
    ``max_minutes`` bounds one invocation only (the run checkpoints and stops; the learning-rate
    schedule is by step, so where a run was stopped never changes the result).

    ``init_from`` (an exported model folder, or ``"reference"`` for the bundled weights) skips the main
    stage: a run without a checkpoint starts at step ``max_steps`` from those weights and their
    tokenizer, with a fresh optimizer (its moments at zero; the recall stage warms its learning rate
    up again), so only the recall stage is trained. Batches depend on the step only, so the recall
    stage sees the same batches as one that followed its own main stage.
    """

    out_dir: str = "runs/reference"
    vocab_size: int = 4096
    hidden_size: int = 320
    intermediate_size: int = 864
    num_layers: int = 5
    num_heads: int = 5
    context: int = 2048
    batch_size: int = 4
    warm_context: int = 512  # the first warm_steps steps train on crops this long (batch scaled up)
    warm_steps: int = 400
    max_steps: int = 2000
    max_minutes: float = 170.0
    stop_at_step: int = 0  # > 0: this invocation stops (and checkpoints) once this step is done
    checkpoint_minutes: float = 10.0
    lr: float = 3e-3
    min_lr: float = FLOOR_LR
    warmup_steps: int = 100
    weight_decay: float = 0.1
    repeat_share: float = 0.2
    kv_share: float = 0.2
    eval_every: int = 100
    eval_sequences: int = 16
    recall_steps: int = 0  # the installed model's stages: 800, 1000, 600 (docs/reference-model.md)
    recall_warm_context: int = 512  # the recall stage's first recall_warm_steps steps train on crops this long
    recall_warm_steps: int = 150
    recall_warm_doublings: int = 0  # > 0: the warm steps in n + 1 equal phases of crops w, 2w, ..., 2^n w (w above)
    recall_name_words: int = DENSE_NAME_WORDS  # name parts of the dense recall format
    recall_lr: float = 1e-3
    recall_warmup_steps: int = 20
    recall_repeat_share: float = 0.2
    recall_kv_share: float = 0.6
    recall_repeat_spans: int = 4  # spans per repeat sequence of the recall stage (data.add_repeats)
    recall_repeat_min_distance: int = 64  # tokens: the recall stage's shortest repeat distance
    recall_induction_share: float = 0.0  # share of induction sequences in the recall stage (data.py; same spans and distances)
    init_from: str = ""  # "" (train the main stage), "reference" or an exported model folder (recall stage only)
    seed: int = 0
    bf16_autocast: bool = False  # slower than float32 on CPUs without bfloat16 instructions
    threads: int = 0  # 0: torch default
    stage_name: str = ""  # what the card calls this run ("": "main", "main + recall" or "recall"); not part of the recipe

    def __post_init__(self) -> None:
        """Check each stage's data mix (:class:`~truncsens.models.reference.data.DataMix`'s own rule) and
        the learning rates before anything is trained or written.

        Raises:
            TrainError: a stage's shares below 0 or summing above 1, fewer than 2 name words, a
                learning rate ≤ 0, or a floor ``min_lr`` above a peak that decays to it (``lr`` unless
                ``init_from`` skips the main stage; ``recall_lr`` with recall steps).
        """
        for stage, mix in (("main", lambda: DataMix(self.repeat_share, self.kv_share)), ("recall", self.recall_mix)):
            try:
                mix()
            except ValueError as err:
                raise TrainError(f"the {stage} stage's data mix: {err}") from None
        for name in ("lr", "min_lr", "recall_lr"):
            if not getattr(self, name) > 0:
                raise TrainError(f"{name} must be > 0, got {getattr(self, name)}")
        peaks = ([] if self.init_from else [("lr", self.lr)]) + ([("recall_lr", self.recall_lr)] if self.recall_steps else [])
        for name, peak in peaks:
            if self.min_lr > peak:
                raise TrainError(f"min_lr (the learning-rate floor, {self.min_lr:g}) must not exceed {name} "
                                 f"(a peak that decays to it, {peak:g})")

    def recall_mix(self) -> DataMix:
        """The recall stage's :class:`~truncsens.models.reference.data.DataMix` (dense key–value format).

        Raises:
            ValueError: shares below 0 or summing above 1, fewer than 2 name words, no span or distance.
        """
        return DataMix(self.recall_repeat_share, self.recall_kv_share, dense_kv=True, name_words=self.recall_name_words,
                       repeat_spans=self.recall_repeat_spans, repeat_min_distance=self.recall_repeat_min_distance,
                       induction=self.recall_induction_share)

    @property
    def total_steps(self) -> int:
        """Steps of the whole run: the main stage, then the recall stage."""
        return self.max_steps + self.recall_steps

    def recipe(self) -> dict:
        """The fields that decide the trained weights (all but out_dir, max_minutes, stop_at_step,
        threads and stage_name)."""
        return {k: v for k, v in asdict(self).items()
                if k not in ("out_dir", "max_minutes", "stop_at_step", "threads", "stage_name")}

    def differences(self, recipe: dict, step: int) -> list[str]:
        """Recipe fields in which ``recipe`` (a checkpoint's, ``step`` steps done) differs from this
        one for the steps already done: the recall stage's fields count only once the checkpoint is
        past the main stage, and a field the checkpoint's recipe does not name (one added after it was
        written) counts as its default, the value that checkpoint ran with."""
        mine, default = self.recipe(), TrainConfig().recipe()
        recall = {k for k in mine if k.startswith("recall_")}
        keys = [k for k in mine if step > self.max_steps or k not in recall]
        return sorted(k for k in keys if recipe.get(k, default[k]) != mine[k])


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


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``; in the
    recall stage the same shape again: warm-up to ``recall_lr`` over ``recall_warmup_steps``, cosine
    decay to ``min_lr`` at ``total_steps``."""
    if step >= cfg.max_steps:
        s, n = step - cfg.max_steps, cfg.recall_steps
        if s < cfg.recall_warmup_steps:
            return cfg.recall_lr * (s + 1) / cfg.recall_warmup_steps
        progress = min(1.0, (s - cfg.recall_warmup_steps) / max(1, n - cfg.recall_warmup_steps))
        return cfg.min_lr + 0.5 * (cfg.recall_lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def crop_at(step: int, cfg: TrainConfig) -> tuple[int, int]:
    """(sequences, tokens each) of step ``step``: ``warm_context`` crops during the first ``warm_steps``
    steps (as many more sequences as keep the tokens per step), then ``context``; in the recall stage
    likewise ``recall_warm_context`` crops for its first ``recall_warm_steps`` steps, then ``context``;
    with ``recall_warm_doublings`` n > 0 those steps fall in n + 1 equal phases whose crops double from
    ``recall_warm_context`` (capped at ``context``), so the recall distances grow with the phases
    (the gaps of :func:`~truncsens.models.reference.data.kv_dense_text` are shares of the crop)."""
    if step < cfg.warm_steps and cfg.warm_context < cfg.context:
        return cfg.batch_size * (cfg.context // cfg.warm_context), cfg.warm_context
    if cfg.max_steps <= step < cfg.max_steps + cfg.recall_warm_steps and cfg.recall_warm_context < cfg.context:
        phases = cfg.recall_warm_doublings + 1
        phase = (step - cfg.max_steps) * phases // cfg.recall_warm_steps  # 0 .. phases - 1, equal shares
        length = min(cfg.context, cfg.recall_warm_context * 2**phase)
        return cfg.batch_size * (cfg.context // length), length
    return cfg.batch_size, cfg.context


@torch.no_grad()
def positional_nll(model, sequences: torch.Tensor, bins: list[tuple[int, int]]) -> list[float]:
    """Mean next-token NLL (nats) of ``sequences`` [n, L+1] in position bins [lo, hi) of the target."""
    model.eval()
    x, y = sequences[:, :-1], sequences[:, 1:]  # [n, L] each
    total = torch.zeros(y.shape[1])
    for i in range(0, x.shape[0], 4):
        logits = model(input_ids=x[i : i + 4]).logits.float()  # [b, L, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y[i : i + 4], reduction="none")
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


def _save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` with torch.save to a temporary file, then rename it over ``path`` (atomic: a run
    killed while saving leaves the previous checkpoint)."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def _tokenizer(cfg: TrainConfig, docs: list[Document], out: Path):
    """The run's tokenizer: trained on the first start, loaded from ``out/final`` on a resume."""
    from transformers import PreTrainedTokenizerFast

    if (out / "final" / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(out / "final"))
    return train_tokenizer(docs, cfg.vocab_size, out / "final")


def _model_config(cfg: TrainConfig, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.context, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        attn_implementation="sdpa",
    )


def train(cfg: TrainConfig) -> Path:
    """Train tokenizer and model, or resume the run in ``cfg.out_dir`` from its checkpoint.

    Writes ``checkpoint.pt`` (weights, optimizer, step; every ``checkpoint_minutes`` and at the end),
    ``train_log.csv`` (appended) and the exported checkpoint folder ``final/``. Returns ``final/``
    once ``total_steps`` are done, or when this invocation's ``max_minutes`` run out (call again to go on).

    Raises:
        TrainError: the working folder holds a checkpoint of a different recipe.
    """
    from transformers import LlamaForCausalLM

    from truncsens.models.reference.data import TrainingData

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    changed = cfg.differences(ckpt["recipe"], ckpt["step"]) if ckpt is not None else []
    if changed:
        raise TrainError(f"{ckpt_path} was trained with another recipe ({', '.join(changed)} differ); "
                         "use another --out-dir or the same options")
    start, start_sha = start_from(cfg.init_from, cfg.recall_steps, out) if ckpt is None and cfg.init_from else (None, None)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))  # once the options are checked

    code, nl = code_documents(), nl_documents()
    train_docs = select_split(code, "train") + select_split(nl, "train")
    tok = _tokenizer(cfg, train_docs, out)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    data = TrainingData([encode(d.text) for d in train_docs], [d.text for d in select_split(code, "train")],
                        tok.eos_token_id, encode, DataMix(cfg.repeat_share, cfg.kv_share), cfg.seed)
    held = _stream(select_split(code, "heldout"), tok)  # [T_heldout]
    g = torch.Generator().manual_seed(cfg.seed + 1)
    L = cfg.context
    starts = torch.randint(0, held.numel() - L - 1, (cfg.eval_sequences,), generator=g)
    eval_seqs = torch.stack([held[s : s + L + 1] for s in starts.tolist()])  # [n, L+1]
    bins = [(8, 24), (56, 72), (248, 264), (L // 2 - 16, L // 2), (L - 64, L)]
    print(f"train tokens {data.stream.size}, heldout code tokens {held.numel()}", flush=True)

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(_model_config(cfg, tok))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    step, tokens, running, minutes_before = 0, 0, None, 0.0
    if start is not None:
        load_start(model, start, cfg.init_from)
        step = cfg.max_steps
        print(f"started at step {step} from {init_folder(cfg.init_from)} (sha256 {start_sha[:12]})", flush=True)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step, tokens, running, minutes_before = ckpt["step"], ckpt["tokens"], ckpt["running"], ckpt["minutes"]
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    new_log = not (out / "train_log.csv").exists() or ckpt is None
    log = open(out / "train_log.csv", "w" if new_log else "a", newline="")
    writer = csv.writer(log)
    if new_log:
        writer.writerow(["step", "tokens", "minutes", "lr", "train_loss", "nll_pos16", "nll_pos64", "nll_pos256",
                         "nll_poshalf", "nll_posmax"])
    t0 = last_save = time.time()

    start_sha = ckpt.get("init_sha256") if ckpt is not None else start_sha

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "tokens": tokens,
                "running": running, "minutes": minutes_before + (time.time() - t0) / 60, "recipe": cfg.recipe(),
                "init_sha256": start_sha}

    recall_mix = cfg.recall_mix()
    last = min(cfg.total_steps, cfg.stop_at_step) if cfg.stop_at_step > 0 else cfg.total_steps
    while step < last and (time.time() - t0) / 60 < cfg.max_minutes:
        n_seq, length = crop_at(step, cfg)
        mix = recall_mix if step >= cfg.max_steps else None  # None: the main stage's mix
        batch = data.batch_at(step, n_seq, length + 1, mix)  # [n_seq, length + 1]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=batch[:, :-1]).logits  # [n_seq, length, V]
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += n_seq * length
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % cfg.eval_every == 0 or step in (cfg.max_steps, cfg.total_steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
                nll = positional_nll(model, eval_seqs, bins)
            minutes = minutes_before + (time.time() - t0) / 60
            writer.writerow([step, tokens, f"{minutes:.2f}", f"{_lr_at(step, cfg):.2e}", f"{running:.4f}"]
                            + [f"{v:.4f}" for v in nll])
            log.flush()
            print(f"step {step} tok {tokens} min {minutes:.1f} loss {running:.3f} nll@pos {['%.3f' % v for v in nll]} "
                  f"gain 256->max {nll[2] - nll[-1]:.3f}", flush=True)
            _export(model, out / "final")
        if (time.time() - last_save) / 60 >= cfg.checkpoint_minutes:
            _save_checkpoint(ckpt_path, state())
            last_save = time.time()
    _save_checkpoint(ckpt_path, state())
    _export(model, out / "final")
    (out / "final" / "training_summary.json").write_text(json.dumps(
        {"parameters": n_params, "steps": step, "tokens_seen": tokens, "finished": step >= cfg.total_steps,
         "minutes": minutes_before + (time.time() - t0) / 60, "config": asdict(cfg),
         **({"init_sha256": start_sha, "earlier_stages": earlier_stages(cfg.init_from),
             "main_stage": main_stage(cfg.init_from)} if cfg.init_from else {})},
        indent=2))
    log.close()
    return out / "final"


if __name__ == "__main__":
    import sys

    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
    base = TrainConfig()
    kwargs = {k: type(getattr(base, k))(v) if not isinstance(getattr(base, k), bool) else v.lower() in ("1", "true") for k, v in overrides.items()}
    train(TrainConfig(**kwargs))
