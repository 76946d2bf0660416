"""Build the shipped tiny model: a character tokenizer and a small Llama, briefly pretrained on a task.

    python tools/make_tiny_model.py          # writes examples/tiny/ (about 2.5 CPU-minutes, one thread)
    python tools/make_tiny_model.py --out /tmp/tiny --steps 500 --noisy-steps 150 --seed 0
    python tools/make_tiny_model.py --deepen 12 --out /tmp/tiny12   # the same function in 12 layers
    python tools/make_tiny_model.py --evaluate examples/tiny --task reverse_longtail --eval-prompts 160

The model (Llama architecture, 4 layers, hidden 128, 4 heads over 2 KV heads = grouped-query
attention, tied embeddings, about 1M parameters, float32 safetensors of 4 MB) is trained with
next-token loss on the answers of the built-in synthetic task (engine/data/tasks.py): clean answers
first, then a last phase on noisy answers (characters after the second replaced by a random letter
with probability 0.7). The result is a reasonable but imperfect policy: sampled at temperature 1 its
mean reward is about 0.45, samples of one prompt share their first answer tokens and then differ, and
GRPO lifts the reward quickly. Llama, not Qwen2: transformers 5 replaces the tokenizer of any
``qwen2`` checkpoint by a byte-level Qwen2Tokenizer rebuilt from the vocabulary, which would silently
drop characters of this one. Seeded and single-threaded by default, so a rerun on the same machine
gives the same weights. The output loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained.

The long-tail benchmarks' 12-layer policy, examples/tiny_longtail/ (model name "tiny_longtail"), is
LONGTAIL_RECIPE, run from the repository root (823 s, about 14 minutes, on one thread of a shared
2-core machine):

    python tools/make_tiny_model.py --task reverse_longtail --out examples/tiny_longtail \
        --init examples/tiny --num-layers 12 --hidden-size 128 --lengths loguniform --steps 560 \
        --noisy-steps 110 --noise 0.2 --lr 2e-3 --batch-size 32 --save-dtype bfloat16

It starts from the shipped 4-layer model deepened to 12 layers (deepen_model: the same function) and
trains every layer (progressive growing); from random weights, a 12-layer model of hidden 96 trained
1200 steps (13.5 CPU-minutes, a curriculum of 8 to 128 characters over the first 600) still reversed
long strings badly (the last row below). The training strings have log-uniform lengths in [1, 128]
(--lengths loguniform: as many of 64-128 characters as of 2-4, about half the tokens in the long ones),
because the task's own distribution (median 1.2) has about 1.5% above 60 characters, too few to learn
them; RL runs keep the task's distribution. The last 110 steps train on answers with 20% of the characters after the
second replaced (--noise 0.2, lower than the 4-layer model's 0.7): enough that samples of one long prompt
differ (GRPO's variance), little enough that the policy stays sure of most tokens (speculative decoding's
acceptance falls with entropy). Its weights are stored in bfloat16 (5.9 MB; float32 would be 11.8 MB), the
trained float32 weights rounded before the evaluation, so that loading them as float32 (exact) computes
what was evaluated. Sampled at temperature 1 (--evaluate, 160 prompts x 8 of the task's eval stream, and
10 x 8 prompts of 60-120 characters), against the deepened 4-layer model on the same prompts:

                                  mean    within-   completion tokens   60-120 characters:
                                  reward  group std median / p99        reward  tokens / answer tokens
    tiny_longtail (this recipe)   0.915   0.045     2 / 68 (x34)        0.283   0.68
    tiny deepened to 12 layers    0.788   0.065     2 / 25 (x12.5)      0.100   0.23
    random init, hidden 96 x 12   0.873   0.050     2 / 45 (x22.5)      0.207   0.57
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

from tailrace.engine.data import tasks  # noqa: E402  (pure Python; torch is imported in main())

# The long-tail policy's recipe (examples/tiny_longtail), as the docstring and docs/benchmarks.md give it.
LONGTAIL_RECIPE = ("--task", "reverse_longtail", "--out", "examples/tiny_longtail", "--init", "examples/tiny",
                   "--num-layers", "12", "--hidden-size", "128", "--lengths", "loguniform", "--steps", "560",
                   "--noisy-steps", "110", "--noise", "0.2", "--lr", "2e-3", "--batch-size", "32",
                   "--save-dtype", "bfloat16")
# The data stream the pretraining draws from; RL runs use other seeds of the same task.
PRETRAIN_SEED_OFFSET = 1_000_000
# Answer characters never corrupted in the noisy phase of pretraining.
CLEAN_PREFIX = 2


def build_tokenizer():
    """Character-level PreTrainedTokenizerFast over tasks.VOCAB: one token per character, <bos> first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(tasks.VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tasks.UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    bos_id = vocab[tasks.BOS_TOKEN]
    core.post_processor = processors.TemplateProcessing(
        single=f"{tasks.BOS_TOKEN} $A",
        pair=f"{tasks.BOS_TOKEN} $A $B",
        special_tokens=[(tasks.BOS_TOKEN, bos_id)],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=tasks.BOS_TOKEN,
        eos_token=tasks.EOS_TOKEN,
        pad_token=tasks.PAD_TOKEN,
        unk_token=tasks.UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    return tokenizer


def save_tokenizer(tokenizer, out: Path) -> None:
    """save_pretrained, declaring the generic fast class so that transformers 4.x and 5.x both load it."""
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def build_model(tokenizer, hidden_size: int, num_layers: int, max_new_tokens: int = 80):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tasks.VOCAB),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
    )
    return model


def _noisy(answer: str, noise: float, rng: random.Random) -> str:
    """Each character after the first ``CLEAN_PREFIX`` replaced by a random letter with probability ``noise``.

    The first characters stay right, so the samples of a group share their first answer tokens and
    branch later, as in real RL workloads.
    """
    return "".join(
        rng.choice(tasks.ALPHABET) if i >= CLEAN_PREFIX and rng.random() < noise else c
        for i, c in enumerate(answer)
    )


def _train_prompts(task: str, seed: int, lengths: str, cap: Callable[[], int], rng: random.Random):
    """Endless pretraining prompts. lengths "task": the task's own stream (another seed than RL's);
    "loguniform": strings of log-uniform length in [1, cap()] (as many of 64-128 characters as of 2-4),
    so that a task whose own lengths are mostly short (reverse_longtail) still teaches long answers."""
    if lengths == "task":
        yield from tasks.synthetic_prompts(task, seed=seed + PRETRAIN_SEED_OFFSET)
    while True:
        length = min(int(math.exp(rng.uniform(0.0, math.log(cap() + 1)))), cap())
        yield tasks.prompt_for_string(task, "".join(rng.choice(tasks.ALPHABET) for _ in range(length)))


def _batches(task: str, seed: int, tokenizer, batch_size: int, group: int, noise: float,
             lengths: str = "task", cap: Callable[[], int] | None = None):
    """Endless (input_ids, labels) batches; examples of similar length are batched together."""
    import torch

    rng = random.Random(seed)
    stream = _train_prompts(task, seed, lengths, cap or (lambda: tasks.max_length(task)), random.Random(seed + 7))
    while True:
        examples = []
        for _ in range(batch_size * group):
            prompt = next(stream)
            prompt_ids = tokenizer(prompt.text)["input_ids"]
            answer = _noisy(str(prompt.metadata["answer"]), noise, rng)
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            examples.append((prompt_ids, answer_ids + [tokenizer.eos_token_id]))
        examples.sort(key=lambda e: len(e[0]) + len(e[1]))
        chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(p) + len(a) for p, a in chunk)
            input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
            labels = torch.full((len(chunk), width), -100)
            for row, (p, a) in enumerate(chunk):
                input_ids[row, : len(p) + len(a)] = torch.tensor(p + a)
                labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
            yield input_ids, labels


def curriculum_cap(step: int, curriculum_steps: int, max_length: int, start: int = 8) -> int:
    """The longest pretraining string at ``step``: from ``start`` characters up to ``max_length``, linearly
    over the first ``curriculum_steps`` steps (0: ``max_length`` throughout)."""
    if step >= curriculum_steps:
        return max_length
    return min(max_length, start + (max_length - start) * step // curriculum_steps)


def pretrain(model, tokenizer, args) -> None:
    """Supervised steps on clean answers, then the last ``noisy_steps`` on noisy answers.

    The clean phase teaches the mechanism; the noisy phase (each answer character replaced by a
    random letter with probability ``noise``) raises the entropy of the next-character distribution
    without unlearning it, so temperature-1 samples of one prompt differ and GRPO has variance to use.
    """
    import torch

    if not 0 <= args.noisy_steps <= args.steps:
        raise ValueError(f"--noisy-steps: must be in [0, --steps], got {args.noisy_steps}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    if not 0 <= args.curriculum_steps <= args.steps:
        raise ValueError(f"--curriculum-steps: must be in [0, --steps], got {args.curriculum_steps}")
    at = {"step": 0}
    max_length = tasks.max_length(args.task)
    cap = lambda: curriculum_cap(at["step"], args.curriculum_steps, max_length)  # noqa: E731
    clean = _batches(args.task, args.seed, tokenizer, args.batch_size, group=8, noise=0.0,
                     lengths=args.lengths, cap=cap)
    noisy = _batches(args.task, args.seed + 1, tokenizer, args.batch_size, group=8, noise=args.noise,
                     lengths=args.lengths, cap=cap)
    model.train()
    start = time.monotonic()
    losses: list[float] = []
    for step in range(1, args.steps + 1):
        at["step"] = step
        input_ids_BT, labels_BT = next(clean if step <= args.steps - args.noisy_steps else noisy)
        attention_mask_BT = input_ids_BT.ne(tokenizer.pad_token_id)
        loss = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, labels=labels_BT).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            mean_loss = statistics.mean(losses[-50:])  # batches are length-sorted: single losses vary a lot
            print(
                f"step {step:4d}/{args.steps}  loss {mean_loss:.3f}  longest {cap()}  "
                f"{time.monotonic() - start:5.0f}s",
                flush=True,
            )
    model.eval()


def sample_rewards(model, tokenizer, prompts, group_size: int, max_new_tokens: int):
    """Sample group_size completions per prompt at temperature 1; returns rewards and lengths per group."""
    import torch

    groups, lengths = [], []
    for prompt in prompts:
        input_ids = torch.tensor([tokenizer(prompt.text)["input_ids"]] * group_size)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)
        completions = out[:, input_ids.shape[1] :]
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        groups.append([tasks.score(prompt.text, t, prompt.metadata) for t in texts])
        lengths.append([row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
                        for row in completions.tolist()])
    return groups, lengths


def evaluate(model, tokenizer, task: str, seed: int, num_prompts: int, group_size: int = 8) -> dict:
    """Sampled figures at temperature 1: on the task's own prompts (its RL distribution: mean reward,
    within-group reward std, completion tokens with EOS median / p99) and on prompts whose answers have
    60-120 characters (mean reward, completion tokens over answer tokens)."""
    import torch

    torch.manual_seed(seed)
    limit = tasks.max_length(task) + 16
    groups, lengths = sample_rewards(model, tokenizer, [tasks.make_prompt(task, seed, i, split="eval")
                                                        for i in range(num_prompts)], group_size, limit)
    flat = sorted(n for g in lengths for n in g)
    p99 = flat[min(len(flat) - 1, int(0.99 * len(flat)))]
    rng = random.Random(seed)
    long_prompts = [tasks.prompt_for_string(task, "".join(rng.choice(tasks.ALPHABET) for _ in range(rng.randint(60, 120))))
                    for _ in range(max(1, num_prompts // 16))]
    long_groups, long_lengths = sample_rewards(model, tokenizer, long_prompts, group_size, limit)
    return {"mean_reward": statistics.mean(r for g in groups for r in g),
            "within_group_std": statistics.mean(statistics.pstdev(g) for g in groups),
            "within_group_std_long": statistics.mean(statistics.pstdev(g) for g in long_groups),
            "len_median": statistics.median(flat), "len_p99": p99, "len_p99_over_median": p99 / statistics.median(flat),
            "long_mean_reward": statistics.mean(r for g in long_groups for r in g),
            "long_len_over_answer": statistics.mean(n / (int(p.metadata["length"]) + 1)
                                                    for p, g in zip(long_prompts, long_lengths, strict=True) for n in g)}


def deepen_model(source, num_layers: int):
    """A deeper copy of the model `source`, computing exactly the same function: layer i of the source is
    layer i * k of the copy (k = num_layers / source layers), followed by k - 1 copies of it whose output
    projections (attention o_proj, MLP down_proj) are zero, so that they add nothing to the residual
    stream until training moves them (function-preserving depth expansion): every layer's output, and so
    the last hidden state, is the source's bit for bit. Deterministic: no random numbers."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(source.config)
    factor, rem = divmod(num_layers, config.num_hidden_layers)
    if rem or factor < 1:
        raise ValueError(f"--deepen: {num_layers} is not a multiple of the {config.num_hidden_layers} source layers")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):  # one entry per layer (transformers 5)
        config.layer_types = [t for t in config.layer_types for _ in range(factor)]
    deep = AutoModelForCausalLM.from_config(config).to(source.dtype)
    state = {}
    for name, tensor in source.state_dict().items():
        if not name.startswith("model.layers."):
            state[name] = tensor
            continue
        index, rest = name[len("model.layers."):].split(".", 1)
        for copy_index in range(factor):
            zero = copy_index > 0 and rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"model.layers.{int(index) * factor + copy_index}.{rest}"] = tensor.clone() * (0.0 if zero else 1.0)
    deep.load_state_dict(state, strict=False)  # tied embeddings: lm_head.weight is the embedding
    deep.generation_config = source.generation_config
    return deep.eval()


def grown_from(src: Path, model):
    """The model in `src` deepened (deepen_model) to `model`'s depth, as `model`'s initialisation: the
    training that follows moves every layer (progressive growing). Raises ValueError unless `src` has
    `model`'s shape but for the depth."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(src, dtype="float32")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "max_position_embeddings"):
        if getattr(source.config, key) != getattr(model.config, key):
            raise ValueError(f"--init: {src} has {key} {getattr(source.config, key)}, "
                             f"the model to train {getattr(model.config, key)}")
    grown = deepen_model(source, model.config.num_hidden_layers)
    grown.generation_config = model.generation_config
    return grown


def save_bfloat16_weights(out: Path) -> None:
    """Rewrite out/model.safetensors in bfloat16 (half the bytes); config.json keeps dtype float32, so a
    plain from_pretrained loads float32 weights equal to the stored ones."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    save_file({k: v.to(__import__("torch").bfloat16).contiguous() for k, v in load_file(path).items()}, path,
              metadata={"format": "pt"})


def deepen(src: Path, out: Path, num_layers: int) -> Path:
    """deepen_model of the model in `src`, written with its tokenizer to `out`: the long-tail benchmarks'
    policy (tools/benches/pipeline.py --workload longtail, tools/benches/spec.py --workload longtail): a
    decode step and a training step cost what a num_layers-deep model costs."""
    import shutil

    from transformers import AutoModelForCausalLM

    deep = deepen_model(AutoModelForCausalLM.from_pretrained(src, dtype="float32"), num_layers)
    out.mkdir(parents=True, exist_ok=True)
    deep.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "examples" / "tiny")
    parser.add_argument("--task", default=tasks.DEFAULT_TASK, choices=tasks.TASK_NAMES)
    parser.add_argument("--steps", type=int, default=500, help="supervised steps (few on purpose)")
    parser.add_argument("--noisy-steps", type=int, default=150, help="the last steps train on noisy answers")
    parser.add_argument(
        "--noise", type=float, default=0.7, help="per-character corruption rate in noisy steps"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; results depend on it")
    parser.add_argument("--eval-prompts", type=int, default=32, help="0 skips the sampled evaluation")
    parser.add_argument("--deepen", type=int, default=0,
                        help="instead: copy the model in --src to --out with this many layers, the same function")
    parser.add_argument("--src", type=Path, default=REPO_ROOT / "examples" / "tiny")
    parser.add_argument("--evaluate", type=Path, default=None,
                        help="instead: the sampled evaluation of the model in this folder on --task")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from the model in this folder deepened to --num-layers (same hidden size)")
    parser.add_argument("--save-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights file dtype; bfloat16 rounds the trained weights first")
    parser.add_argument("--lengths", default="task", choices=("task", "loguniform"),
                        help="pretraining string lengths: the task's own, or log-uniform up to its longest")
    parser.add_argument("--curriculum-steps", type=int, default=0,
                        help="the longest pretraining string grows from 8 characters to the task's longest "
                             "over these first steps")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.evaluate:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(args.threads)
        model = AutoModelForCausalLM.from_pretrained(args.evaluate, dtype="float32").eval()
        _print_evaluation(model, AutoTokenizer.from_pretrained(args.evaluate), args)
        return
    if args.deepen:
        print(f"deepened to {args.deepen} layers: {deepen(args.src, args.out, args.deepen)}")
        return

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.hidden_size, args.num_layers, tasks.max_length(args.task) + 16)
    if args.init:
        model = grown_from(args.init, model)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"llama hidden {args.hidden_size} x {args.num_layers} layers: {num_params / 1e6:.2f}M parameters")
    pretrain(model, tokenizer, args)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.save_dtype == "bfloat16":  # bf16 -> float32 is exact: loaded as float32 it computes what is stored
        model = model.to(torch.bfloat16).to(torch.float32)
    model.save_pretrained(args.out, safe_serialization=True)
    if args.save_dtype == "bfloat16":
        save_bfloat16_weights(args.out)
    save_tokenizer(tokenizer, args.out)
    size_mb = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file()) / 1e6
    print(f"saved to {args.out} ({size_mb:.1f} MB)")

    if args.eval_prompts:
        _print_evaluation(model, tokenizer, args)


def _print_evaluation(model, tokenizer, args) -> None:
    e = evaluate(model, tokenizer, args.task, args.seed, args.eval_prompts)
    print(f"sampled at T=1 on {args.task}, {args.eval_prompts} prompts x 8: mean reward {e['mean_reward']:.3f}, "
          f"within-group std {e['within_group_std']:.3f}, completion tokens median {e['len_median']} "
          f"p99 {e['len_p99']} (x{e['len_p99_over_median']:.1f}); answers of 60-120 characters: mean reward "
          f"{e['long_mean_reward']:.3f}, within-group std {e['within_group_std_long']:.3f}, completion "
          f"tokens / answer tokens {e['long_len_over_answer']:.2f}")


if __name__ == "__main__":
    main()
