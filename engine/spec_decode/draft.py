"""Draft-model proposals: a smaller checkpoint with the model's tokenizer guesses the next k
tokens greedily, one forward pass of its own per draft position, over its own paged KV.

The draft keeps, per sample it proposes for, a Sequence of its own: the sample's tokens as
far as the draft has seen them, then the draft's last guesses, and the blocks of its own pool
(a BlockPool and a ModelRunner of the draft model, no prefix cache) holding their KV:

    sample:   t0 ... t(L-1) x0 x1         (after a verify that kept d0 and then x1 != d1)
    draft:    t0 ... t(L-1) d0 d1 d2      KV computed for t0 .. d1 in the last proposal
    synced:   t0 ... t(L-1) d0 | rewound: the KV of d1 is stale, its block freed if only it
                                 held it (KVCacheManager.rewind, as the model's own KV)

A proposal then runs k passes over the samples that may speculate:

    pass 1    each sample's tokens the draft has not computed (one or two after a verify; the
              whole prompt the first time), argmax at the last: d0
    pass j    d(j-2)'s KV, argmax: d(j-1)                                  (j = 2 .. k)

The draft's KV of a prompt is computed lazily, by the first proposal for the sample, on the
worker that speculates: colocated, the step after its first token; under P/D, on the decode
worker (the prefill worker never holds a draft model). So a draft never delays a first token,
no draft KV travels with a lease, and the prefill worker needs no second model. Catching up
is limited to the step's token budget (max_num_batched_tokens): a long prompt's draft KV is
computed over several steps, the sample speculating once it is done.

The draft never preempts anything: when its pool is short, the draft KV of samples not
proposing in this step (paused, preempted, or in a batch too large to speculate) is dropped
first, and a sample that still does not fit gets no draft this step. A sample's draft blocks
go back to the pool when it finishes (`release`).

Drafts are point guesses (argmax), which the verify rule keeps or rejects exactly
(engine/spec_decode/speculator.py), sampled requests included. Drafted ids stay below both
models' vocabulary sizes (two checkpoints of one tokenizer may pad their embeddings
differently).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import CacheConfig, ModelConfig, SpeculativeConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.model_runner import ModelRunner
from tandem.engine.model_source import resolve_model
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.engine.spec_decode.proposer import ProposeInput
from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

# The longest catch-up run as decode rows (1 + the most draft tokens a step verifies).
MAX_VERIFY_ROWS = 17


@dataclass(frozen=True)
class DraftSetup:
    """What the draft model's runner takes from the engine: where it runs, and the model's
    checkpoint and lengths (its vocabulary is checked against the draft's)."""

    device: str
    dtype: str
    load_format: str
    seed: int
    block_size: int
    cpu_kv_bytes: int
    cuda_graphs: bool
    max_num_batched_tokens: int
    max_model_len: int
    target_dir: Path
    target_vocab_size: int


@dataclass
class _Draft:
    """The draft's state of one sample: its own Sequence (tokens, blocks, computed length),
    and how many of its leading tokens are known to equal the sample's."""

    seq: Sequence
    synced: int = 0


class DraftProposer:
    def __init__(self, runner: ModelRunner, vocab_size: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.kv = KVCacheManager(self.pool)
        self.vocab_size = vocab_size  # drafted ids stay below it
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self._drafts: dict[int, _Draft] = {}  # the sample's seq_id -> its draft state

    @classmethod
    def load(cls, spec: SpeculativeConfig, setup: DraftSetup) -> DraftProposer:
        """The draft model on the engine's device, after checking it shares the model's
        tokenizer; its KV pool of spec.draft_num_blocks blocks, or sized as the model's is
        (engine/pool_sizing.py) with spec.draft_memory_fraction of the free memory."""
        draft_dir = resolve_model(spec.draft_model)
        cfg = ModelConfig.from_dir(draft_dir)
        check_same_vocabulary(setup.target_dir, setup.target_vocab_size, draft_dir,
                              cfg.vocab_size)
        max_len = min(setup.max_model_len, cfg.max_model_len)
        cache = CacheConfig(setup.block_size, spec.draft_num_blocks, spec.draft_memory_fraction,
                            setup.cpu_kv_bytes, enable_prefix_caching=False)
        try:
            runner = ModelRunner(
                cfg, cache, device=setup.device, dtype=setup.dtype, model_dir=draft_dir,
                load_format=setup.load_format, seed=setup.seed,
                max_num_batched_tokens=setup.max_num_batched_tokens, max_model_len=max_len,
                # Rows of a pass: one per speculating sample (at most max_batch), two for
                # those catching up after a verify that kept every draft (_as_verify_rows).
                max_num_seqs=2 * spec.max_batch, cuda_graphs=setup.cuda_graphs,
                mixed_cuda_graphs=False, progress=False)
        except InvalidArgument as e:  # the pool's sizing: name the draft's own flag
            field = "draft_memory_fraction" if e.field == "memory_fraction" else e.field
            raise InvalidArgument(field, f"the draft model ({spec.draft_model}): "
                                  f"{e.message}") from None
        log.info("draft model %s: %d layers, KV pool of %d blocks", spec.draft_model,
                 cfg.num_layers, runner.num_blocks)
        return cls(runner, min(cfg.vocab_size, setup.target_vocab_size),
                   min(max_len, runner.num_blocks * runner.block_size),
                   setup.max_num_batched_tokens)

    # -- Proposer ------------------------------------------------------------------------
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in inp.seqs]
        live = {s.seq_id for s in inp.seqs}
        # Pass 1: catch up and guess d0, within the step's token budget.
        budget = self.max_num_batched_tokens
        items: list[tuple[int, Sequence, int, bool]] = []  # (index, draft seq, tokens, samples)
        room: dict[int, int] = {}
        for i, (seq, k) in enumerate(zip(inp.seqs, inp.max_tokens)):
            k = min(k, self.max_model_len - seq.num_tokens)
            if k <= 0 or budget <= 0:
                continue
            d = self._sync(seq)
            n = min(d.num_tokens - d.num_computed_tokens, budget)
            if not self._allocate(d, n, live):
                continue
            budget -= n
            done = d.num_computed_tokens + n == d.num_tokens
            items.append((i, d, n, done))
            room[i] = k if done else 0
        tokens = self._forward([(d, n, done) for _, d, n, done in items])
        step = []
        for (i, d, _, done), tok in zip(items, tokens):
            if done:
                d.token_ids.append(tok)
                drafts[i].append(tok)
                step.append((i, d))
        # Passes 2..k: one token each, the last guess's KV, for the samples with room left.
        for j in range(1, max(room.values(), default=0)):
            step = [(i, d) for i, d in step if room[i] > j and self._allocate(d, 1, live)]
            if not step:
                break
            for (i, d), tok in zip(step, self._forward([(d, 1, True) for _, d in step])):
                d.token_ids.append(tok)
                drafts[i].append(tok)
        return drafts

    def release(self, seq: Sequence) -> None:
        draft = self._drafts.pop(seq.seq_id, None)
        if draft is not None:
            self._drop(draft.seq)

    def is_idle(self) -> bool:
        return not self._drafts and self.pool.is_idle()

    # -- the draft's sequences -----------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The sample's draft Sequence, its tokens made the sample's and its KV rewound to
        the longest prefix it computed over the same tokens (a rejected guess's KV dropped)."""
        draft = self._drafts.get(seq.seq_id)
        if draft is None:
            draft = self._drafts[seq.seq_id] = _Draft(Sequence(f"draft-{seq.seq_id}", [],
                                                               SamplingParams()))
        d, tokens = draft.seq, seq.token_ids
        j = draft.synced  # the sample's tokens never change once appended
        end = min(d.num_tokens, len(tokens))
        while j < end and d.token_ids[j] == tokens[j]:
            j += 1
        del d.token_ids[j:]
        d.token_ids.extend(tokens[j:])
        draft.synced = len(tokens)
        keep = min(d.num_computed_tokens, j, len(tokens) - 1)  # the last token is computed now
        if keep < d.num_computed_tokens:
            self.kv.rewind(d, keep)
        return d

    def _allocate(self, d: Sequence, n: int, live: set[int]) -> bool:
        """Blocks for n more tokens of d; when the pool is short, the drafts of samples not
        proposing now are dropped first. False: no room (d unchanged)."""
        if self.kv.allocate_slots(d, n):
            return True
        stale = [sid for sid in self._drafts if sid not in live]
        for sid in stale:
            self._drop(self._drafts.pop(sid).seq)
        return bool(stale) and self.kv.allocate_slots(d, n)

    def _drop(self, d: Sequence) -> None:
        self.kv.free(d)
        d.num_computed_tokens = 0
        self.runner.release(d.seq_id)

    def _forward(self, items: list[tuple[Sequence, int, bool]]) -> list[int]:
        """One forward pass of the draft model over items (sequence, new tokens, whether its
        last token's argmax is wanted); each sequence's computed length advances. Returns
        the argmax of each item (0 for those not wanted)."""
        if not items:
            return []
        order = sorted(range(len(items)), key=lambda i: items[i][1] != 1)  # decodes first
        batch = ScheduledBatch()
        rows, wanted = [], []
        offset = 0
        for i in order:
            d, n, sample = items[i]
            batch.seqs.append(d)
            batch.num_new_tokens.append(n)
            offset += n
            if sample:
                rows.append(offset - 1)
                wanted.append(i)
        if not rows:  # catching up only: KV written, nothing to guess yet
            rows = [offset - 1]
        moved = _as_verify_rows(batch)
        try:
            logits, greedy = self.runner.forward(self.runner.step_inputs(batch, rows))
        except Exception:  # nothing computed: the blocks allocated for this pass go back
            for d in batch.seqs:
                self.kv.rewind(d, d.num_computed_tokens)
            raise
        finally:
            for d in moved:
                d.token_ids += d.spec_token_ids
                d.spec_token_ids = []
        if greedy is None or logits.shape[-1] > self.vocab_size:
            greedy = logits[:, :self.vocab_size].argmax(dim=-1)
        picked = greedy.tolist()
        for d, n in zip(batch.seqs, batch.num_new_tokens):
            d.num_computed_tokens += n
        out = [0] * len(items)
        for i, tok in zip(wanted, picked):
            out[i] = tok
        return out


def _as_verify_rows(batch: ScheduledBatch) -> list[Sequence]:
    """After a verify that kept every draft, a sample's draft has two tokens to catch up (the
    last draft and the model's next token), so the first pass would be a mixed step, run
    eagerly. Such short catch-ups, ending at the sequence's end, are handed to the runner as
    a verify's are (the first token in token_ids, the rest in spec_token_ids): a pass of only
    those and one-token rows then runs as decode rows and replays a decode CUDA graph
    (engine/model_runner.py `_as_decode_rows`); the same KV and logits either way.
    Returns the sequences changed, whose tokens _forward puts back after the pass."""
    moved = []
    for d, n in zip(batch.seqs, batch.num_new_tokens):
        if 1 < n <= MAX_VERIFY_ROWS and d.num_computed_tokens + n == d.num_tokens:
            cut = d.num_computed_tokens + 1
            d.spec_token_ids = d.token_ids[cut:]
            del d.token_ids[cut:]
            moved.append(d)
    return moved


def check_same_vocabulary(target_dir: Path, target_vocab: int, draft_dir: Path,
                          draft_vocab: int) -> None:
    """The draft must speak the model's tokenizer: the same tokenizer.json vocabulary where
    both checkpoints have one (their embedding sizes may differ by padding), else the same
    vocabulary size."""
    target, draft = _vocabulary(target_dir), _vocabulary(draft_dir)
    if target is not None and draft is not None:
        if target != draft:
            raise InvalidArgument("draft_model", f"{draft_dir} has a different tokenizer "
                                  "from the model's: a draft model must share its tokenizer")
        return
    if target_vocab != draft_vocab:
        raise InvalidArgument("draft_model", f"vocabulary size {draft_vocab} differs from the "
                              f"model's {target_vocab}: a draft model must share its tokenizer")


def _vocabulary(model_dir: Path) -> tuple | None:
    """tokenizer.json's token -> id map and added tokens, where the checkpoint has one."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    spec = json.loads(path.read_text(encoding="utf-8"))
    added = sorted((a.get("id"), a.get("content")) for a in spec.get("added_tokens") or ())
    return (json.dumps((spec.get("model") or {}).get("vocab"), sort_keys=True), tuple(added))
