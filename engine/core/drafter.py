"""The speculative-decoding drafter: one EAGLE-style decoder layer on top of the policy's hidden states.
Shared from below: generators run and train it, the trainer checks uploads against expected_state().

    input at token t:  fc([embed(x_t), h_{t-1}])       h_{t-1}: the policy's last hidden state (after its
                       -> decoder layer (attention over  final norm) at the previous token, which is the
                          the drafter's own keys/values)  one that predicted x_t; zeros for the first token
                       -> norm -> ĥ_t ≈ h_t             logits of x_{t+1}: the policy's lm_head(ĥ_t)

The policy's embedding and LM head are shared by reference, frozen and never copied: they are not
registered as submodules, so the drafter's state dict, parameters and optimizer hold only its own layer.
While drafting, the drafter feeds its own prediction ĥ back as the next feature. The keys/values live in
the backend's SlotKVCache (one extra layer), so they follow every layout change of the batch.

Saved as a folder (drafter.safetensors + drafter.json with its config and version); shared between
generators as a plain name -> tensor dict plus a version (the protocol's "drafter" weights).
Test: pytest tests/engine/generator/speculation/test_drafter.py
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.engine.core.weights import check_same_layout

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter.json"


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 4096  # rotary table size: the policy's max_position_embeddings plus drafting slack

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"drafter.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"drafter.num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")

    @classmethod
    def from_policy(cls, config) -> DrafterConfig:
        """The shape of one of the policy's own decoder layers."""
        num_heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(hidden_size=config.hidden_size, num_heads=num_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
                   intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                   rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6), rope_theta=float(theta),
                   max_positions=getattr(config, "max_position_embeddings", 4096) + 16)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _rotate(x_BhTd: torch.Tensor, turns_B1Tc: torch.Tensor) -> torch.Tensor:
    """Rotary positions on interleaved pairs (x[2i], x[2i+1]) as one complex multiply: fewer ops than
    the rotate-half form, and the drafter's layout is its own."""
    real = x_BhTd if x_BhTd.dtype == torch.float32 else x_BhTd.float()  # no-op dispatches cost too
    out = torch.view_as_real(torch.view_as_complex(real.unflatten(-1, (-1, 2))) * turns_B1Tc).flatten(-2)
    return out if out.dtype == x_BhTd.dtype else out.to(x_BhTd.dtype)


class Drafter(nn.Module):
    """One decoder layer (RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP) behind
    a projection of [token embedding, feature]. `version` counts published trained states."""

    def __init__(self, config: DrafterConfig, embed: nn.Embedding, lm_head: nn.Module):
        super().__init__()
        c = self.config = config
        if embed.num_embeddings != c.vocab_size or embed.embedding_dim != c.hidden_size:
            raise ValueError(f"drafter: the policy's embedding is {tuple(embed.weight.shape)}, the drafter "
                             f"expects ({c.vocab_size}, {c.hidden_size})")
        self._shared = (embed, lm_head)  # a tuple, so nn.Module does not register (or train, or save) them
        # Detached aliases (same storage, so in-place policy weight updates show through): training the
        # drafter must not touch, or accumulate gradients on, the policy.
        bias = getattr(lm_head, "bias", None)
        self._frozen = (embed.weight.detach(), lm_head.weight.detach(), None if bias is None else bias.detach())
        self.version = 0
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv = nn.Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=False)
        self.post_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.out_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        # Rotary table [max_positions, head_dim / 2] of unit complex numbers: drafting calls the layer
        # once per token, so every op saved per call counts on a CPU.
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        angles = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv_freq
        # A plain attribute, not a buffer: Module.to(dtype) would cast it to real.
        self._rope_turns = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
        self._init_weights()

    @classmethod
    def for_policy(cls, policy: nn.Module, config: DrafterConfig | None = None, seed: int = 0) -> Drafter:
        """A fresh drafter for `policy` (trained later from the policy's own rollouts), on its device and
        in its dtype."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls(config or DrafterConfig.from_policy(policy.config), policy.get_input_embeddings(),
                          policy.get_output_embeddings())
        weight = policy.get_input_embeddings().weight
        drafter.to(device=weight.device, dtype=weight.dtype)
        return drafter.requires_grad_(False)  # the spot trainer turns gradients on while it trains

    def _init_weights(self) -> None:
        for linear in (self.fc, self.qkv, self.o_proj, self.gate_up, self.down):
            nn.init.normal_(linear.weight, std=linear.in_features ** -0.5)
        # Start near "the next hidden state is the current one", the best guess before any training.
        with torch.no_grad():
            hidden = self.config.hidden_size
            self.fc.weight[:, hidden:] += torch.eye(hidden)
            self.o_proj.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    def embed(self, ids_BT: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids_BT, self._frozen[0])

    def logits(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """Next-token logits from (predicted) hidden states, through the policy's own (frozen) LM head."""
        return F.linear(hidden_BTH, self._frozen[1], self._frozen[2])

    def rotary(self, positions_BT: torch.Tensor) -> torch.Tensor:
        """The rotary factors [B, 1, T, head_dim / 2] of these positions, as forward() takes them: drafting
        looks up a step's k positions once instead of once per drafted token."""
        if self._rope_turns.device != positions_BT.device:
            with torch.inference_mode(False):  # kept for training too, so never an inference tensor
                self._rope_turns = self._rope_turns.to(positions_BT.device)
        return self._rope_turns[positions_BT][:, None]

    def forward(self, ids_BT: torch.Tensor, features_BTH: torch.Tensor, positions_BT: torch.Tensor | None,
                mask_B1TK: torch.Tensor, cache=None, layer_idx: int = 0,
                turns_B1Tc: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted hidden states ĥ [B, T, H]. features_BTH[:, t] is the hidden state of the token
        before ids_BT[:, t]. With `cache` (a SlotKVCache with its window set by the caller) the new
        keys/values are stored at `layer_idx` and the mask [B, 1, T, K] covers the visible columns;
        without it the mask is [B, 1, T, T] over these tokens alone (training on packed samples).
        turns_B1Tc: rotary(positions_BT), when the caller has it (then positions_BT is not read)."""
        # Functional calls on the layer's own parameters: drafting runs this once per drafted token, and
        # on a CPU every nn.Module call and every dispatched op costs microseconds.
        c, hidden = self.config, (self.config.hidden_size,)
        embedded = F.embedding(ids_BT, self._frozen[0])
        if embedded.dtype != features_BTH.dtype:
            embedded = embedded.to(features_BTH.dtype)
        x = F.linear(torch.cat((embedded, features_BTH), dim=-1), self.fc.weight)
        batch, num_new, _ = x.shape
        num_qk = c.num_heads + c.num_kv_heads
        normed = F.rms_norm(x, hidden, self.input_norm.weight, c.rms_norm_eps)
        qkv = F.linear(normed, self.qkv.weight).view(batch, num_new, num_qk + c.num_kv_heads, c.head_dim)
        qkv = qkv.transpose(1, 2)  # [B, heads of q, k and v, T, d]
        if turns_B1Tc is None:
            turns_B1Tc = self.rotary(positions_BT)
        qk = _rotate(qkv[:, :num_qk], turns_B1Tc)  # q and k in one go
        q, k, v = qk[:, :c.num_heads], qk[:, c.num_heads:], qkv[:, num_qk:]
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TK,
                                              enable_gqa=c.num_kv_heads != c.num_heads)
        x = x + F.linear(attn.transpose(1, 2).reshape(batch, num_new, c.num_heads * c.head_dim), self.o_proj.weight)
        normed = F.rms_norm(x, hidden, self.post_norm.weight, c.rms_norm_eps)
        gate, up = F.linear(normed, self.gate_up.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, self.down.weight)
        return F.rms_norm(x, hidden, self.out_norm.weight, c.rms_norm_eps)

    # ------------------------------------------------------------------ state: files and wire

    def export_state(self) -> dict[str, torch.Tensor]:
        """The drafter's own tensors (name -> detached CPU copy), for WeightsStore.publish("drafter")."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.state_dict().items()}

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Take a full state (from export_state, a file or the wire) as `version`. Validates every
        name and shape before copying any, so a bad dict leaves the drafter untouched."""
        own = self.state_dict()
        check_same_layout(state, own, "drafter state")
        for name, value in state.items():
            own[name].copy_(torch.as_tensor(value))
        self.version = version

    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.export_state(), str(folder / WEIGHTS_FILE))
        meta = {"version": self.version, "config": asdict(self.config)}
        (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, folder: str | Path, policy: nn.Module) -> Drafter:
        """A drafter saved by save(), attached to `policy` (whose shapes it must match)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        meta = json.loads((folder / CONFIG_FILE).read_text())
        drafter = cls.for_policy(policy, DrafterConfig(**meta["config"]))
        drafter.load_state(load_file(str(folder / WEIGHTS_FILE)), int(meta["version"]))
        return drafter


def expected_state(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The state a drafter for `policy` has (names, shapes, dtypes), as tensors on the meta device: no
    memory, no initialisation. What the trainer checks drafter uploads against."""
    weight = policy.get_input_embeddings().weight
    config = DrafterConfig.from_policy(policy.config)
    with torch.device("meta"):
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        drafter = Drafter(config, embed, nn.Linear(config.hidden_size, config.vocab_size, bias=False))
    return {name: t.to(dtype=weight.dtype) for name, t in drafter.state_dict().items()}


def load_or_create(folder: str | Path | None, policy: nn.Module, seed: int = 0) -> Drafter:
    """The run's saved drafter when `folder` holds one; otherwise a fresh drafter for the policy, which
    the spot trainer then initialises from the policy's own rollouts."""
    if folder is not None and (Path(folder) / CONFIG_FILE).is_file():
        return Drafter.load(folder, policy)
    return Drafter.for_policy(policy, seed=seed)
