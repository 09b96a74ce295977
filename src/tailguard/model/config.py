"""MistralConfig: the architecture numbers of a checkpoint, read from its `config.json`.

No torch here: the HTTP process imports this module to learn the vocabulary and context size.

`from_dict` follows transformers' `MistralConfig` defaults for fields a checkpoint may omit
(`num_key_value_heads` = heads, `head_dim` = hidden / heads, `sliding_window` = 4096 when the
key is absent, null = full attention), and refuses what our compact model does not implement
(RoPE scaling, other activations, attention biases) with an error naming the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailguard.errors import ModelLoadError

__all__ = ["CONFIG_FILE", "SUPPORTED_DTYPES", "MistralConfig", "hf_weight_shapes"]

CONFIG_FILE = "config.json"
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_ACCEPTED_MODEL_TYPES = ("mistral",)
_HF_DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default when the key is absent


@dataclass(frozen=True)
class MistralConfig:
    """Architecture of a Mistral-family decoder; field names follow Hugging Face's config.json."""

    vocab_size: int  # rows of the embedding and the output head
    hidden_size: int  # model width
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (grouped-query attention); divides num_attention_heads
    head_dim: int  # per-head width (hidden_size // heads unless the checkpoint says otherwise)
    max_position_embeddings: int  # longest sequence (prompt + output) the model is trained for
    rms_norm_eps: float
    rope_theta: float  # rotary base frequency
    sliding_window: int | None  # a query sees keys with q_pos - k_pos < sliding_window; None = all
    tie_word_embeddings: bool  # output head shares the embedding matrix
    bos_token_id: int
    eos_token_id: int
    torch_dtype: str = "float32"  # dtype of the stored weights: float32 | bfloat16 | float16
    # where the values came from, for error messages; not serialised, not compared
    source: str = field(default=CONFIG_FILE, compare=False, repr=False)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise self._error(name, f"must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise self._error(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads="
                f"{self.num_attention_heads}; grouped-query attention needs whole groups",
            )
        if self.head_dim % 2:
            raise self._error(
                "head_dim", f"must be even for rotary embeddings, got {self.head_dim}"
            )
        if not self.rms_norm_eps > 0:
            raise self._error("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise self._error("rope_theta", f"must be > 0, got {self.rope_theta!r}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise self._error(
                "sliding_window",
                f"must be a positive integer or null, got {self.sliding_window!r}",
            )
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise self._error(
                    name, f"must be a token id in [0, {self.vocab_size}), got {value!r}"
                )
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise self._error(
                "torch_dtype",
                f"{self.torch_dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}",
            )

    def _error(self, field: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: field '{field}' {problem}", param=field)

    @property
    def kv_elements_per_token(self) -> int:
        """K+V cache elements one token occupies across all layers (times dtype size = bytes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    # ---- reading -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: Path | str) -> MistralConfig:
        """Read `<path>/config.json`; errors name the file and the field."""
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            raise ModelLoadError(
                f"{file} not found: a model folder needs a Hugging Face config.json "
                "(point --model at the folder that holds config.json and model.safetensors)",
                param=CONFIG_FILE,
            )
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{file}: cannot be read as JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ModelLoadError(f"{file}: expected a JSON object at the top level")
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = CONFIG_FILE) -> MistralConfig:
        """Validate a Hugging Face config dict (transformers 4.x or 5.x layout)."""

        def err(field: str, problem: str) -> ModelLoadError:
            return ModelLoadError(f"{source}: field '{field}' {problem}", param=field)

        model_type = d.get("model_type")
        if model_type is not None and model_type not in _ACCEPTED_MODEL_TYPES:
            raise err(
                "model_type",
                f"is {model_type!r}; tailguard serves the Mistral architecture only "
                f"(model_type 'mistral', MistralForCausalLM)",
            )
        archs = d.get("architectures")
        if archs is not None and archs != ["MistralForCausalLM"]:
            raise err("architectures", f"is {archs!r}; expected ['MistralForCausalLM']")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise err("hidden_act", f"is {act!r}; only 'silu' (SwiGLU) is implemented")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise err(flag, "is true; biases in attention/MLP are not implemented")
        if d.get("layer_types") is not None and any(
            t != "sliding_attention" and t != "full_attention" for t in d["layer_types"]
        ):
            raise err("layer_types", f"has unknown entries {d['layer_types']!r}")
        if d.get("layer_types") is not None and len(set(d["layer_types"])) > 1:
            raise err(
                "layer_types",
                "mixes sliding and full attention layers; only one attention kind is implemented",
            )

        def required(field: str) -> Any:
            if field not in d or d[field] is None:
                raise err(field, "is missing; it is required to build the model")
            return d[field]

        hidden = required("hidden_size")
        heads = required("num_attention_heads")
        kv_heads = d.get("num_key_value_heads")
        if kv_heads is None:  # transformers: multi-head attention when absent
            kv_heads = heads
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
                raise err("hidden_size", f"{hidden!r} / num_attention_heads {heads!r} is not valid")
            if hidden % heads:
                raise err(
                    "head_dim",
                    f"is absent and hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads}; add head_dim to config.json",
                )
            head_dim = hidden // heads

        rope_theta = _rope_theta(d, err)
        # absent -> transformers' default window; explicit null -> full attention
        sliding = d.get("sliding_window", _HF_DEFAULT_SLIDING_WINDOW)

        eos = d.get("eos_token_id", 2)
        if isinstance(eos, list):  # several stop ids: the first is the canonical end of sequence
            if not eos:
                raise err("eos_token_id", "is an empty list")
            eos = eos[0]
        bos = d.get("bos_token_id", 1)
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"

        return cls(
            vocab_size=required("vocab_size"),
            hidden_size=hidden,
            intermediate_size=required("intermediate_size"),
            num_hidden_layers=required("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 4096 * 32),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            sliding_window=sliding,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=1 if bos is None else bos,
            eos_token_id=2 if eos is None else eos,
            torch_dtype=str(dtype),
            source=source,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a transformers MistralForCausalLM loads (4.x and 5.x keys both)."""
        d = asdict(self)
        del d["source"]
        d["dtype"] = d["torch_dtype"]
        d.update(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            hidden_act="silu",
            attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return d

    def write(self, folder: Path) -> Path:
        """Write `<folder>/config.json`; returns the file path."""
        file = folder / CONFIG_FILE
        file.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return file


def _rope_theta(d: dict[str, Any], err: Any) -> float:
    """rope_theta from either layout; refuse any RoPE scaling (YaRN, linear, dynamic, ...)."""
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise err(key, f"must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise err(
                key,
                f"asks for RoPE scaling {rope_type!r}; only plain rotary embeddings "
                "(rope_type 'default') are implemented",
            )
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
    if theta is None:
        theta = 10000.0  # transformers' default base
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise err("rope_theta", f"must be a number, got {theta!r}")
    return float(theta)


def hf_weight_shapes(config: MistralConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Mistral checkpoint must hold, with its shape."""
    h, hd = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_dim, h),
            p + "self_attn.k_proj.weight": (kv_dim, h),
            p + "self_attn.v_proj.weight": (kv_dim, h),
            p + "self_attn.o_proj.weight": (h, q_dim),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
    return shapes
