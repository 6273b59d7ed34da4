"""What a sentence-transformers model folder says: how texts are prepared and how token
states become one vector.

`SentenceTransformer(folder).encode` runs the modules listed in `modules.json`: the
Transformer, a Pooling (CLS, mean, max, …, possibly several concatenated), maybe a
Normalize. `embed` must do the same or its vectors are silently different (a CLS-pooling
folder mean-pooled gave cosine 0.20). This module only reads the folder's JSON files; the
pooling itself runs in `jobs/embed.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.errors import UsageError

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' older Pooling configs: one flag per mode, concatenated in this order
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DEFAULT_MAX_LENGTH = 256  # tokens per row when neither --max-length nor the model folder says


@dataclass(frozen=True)
class TextSettings:
    """How the folder's texts are prepared, whatever the job (sentence_bert_config.json and
    config_sentence_transformers.json)."""

    max_seq_length: int | None = None  # the default --max-length
    lowercase: bool = False  # do_lower_case
    prompts: dict = field(default_factory=dict)  # name → text put before every row
    default_prompt_name: str | None = None


@dataclass(frozen=True)
class EmbeddingRecipe:
    """How `embed` pools and normalises for one model folder."""

    pooling: tuple[str, ...] = ("mean",)  # modes, concatenated in this order
    normalize: bool = True
    include_prompt: bool = True  # False: prompt tokens are left out of the pooling
    source: str = ""  # where this came from, for the log

    def describe(self) -> str:
        return (f"{' + '.join(self.pooling)} pooling{', normalized' if self.normalize else ', not normalized'}"
                f"{'' if self.include_prompt else ', prompt excluded from pooling'}")


def _read_json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path}: {error}; is the model folder complete?") from error


def pooling_modes(config: dict, where: Path) -> tuple[str, ...]:
    """The modes of a Pooling config, new (`pooling_mode`) or legacy (`pooling_mode_*` flags) form."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(name for flag, name in LEGACY_POOLING_FLAGS.items() if config.get(flag))
        modes = modes or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise UsageError(f"{where}: pooling mode {', '.join(map(repr, unknown)) or 'none'} is not one lengthwise "
                         f"runs ({', '.join(POOLING_MODES)})")
    return modes


def read_embedding_recipe(model_path: str) -> EmbeddingRecipe:
    """The folder's sentence-transformers recipe; without `modules.json`, mean pooling and
    L2 normalisation (what all-MiniLM-L6-v2 uses), saying so in `source`.

    A module that lengthwise does not run (Dense, LayerNorm, …) is refused: its vectors would
    differ from sentence-transformers' without a word.
    """
    folder = Path(model_path)
    modules = _read_json(folder / "modules.json")
    if modules is None:
        return EmbeddingRecipe(source=f"no sentence-transformers modules.json in {model_path}: "
                                      "mean pooling + L2 normalisation")
    pooling, normalize, include_prompt = None, False, True
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = module.get("path", "")
        if kind == "Transformer":
            if path not in ("", "."):
                raise UsageError(f"{folder / 'modules.json'}: the transformer lives in the subfolder {path!r}; "
                                 "lengthwise reads models whose weights are at the top of the folder")
        elif kind == "Pooling":
            config = _read_json(folder / path / "config.json") or {}
            pooling = pooling_modes(config, folder / path / "config.json")
            include_prompt = bool(config.get("include_prompt", True))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UsageError(f"{folder / 'modules.json'} has a {module.get('type')} module ({path or 'no path'}) "
                             "that lengthwise does not run, so its embeddings would differ from "
                             "sentence-transformers'; lengthwise runs Transformer, Pooling and Normalize modules")
    if pooling is None:
        raise UsageError(f"{folder / 'modules.json'} has no Pooling module; lengthwise needs one vector per row")
    return EmbeddingRecipe(pooling=pooling, normalize=normalize, include_prompt=include_prompt,
                           source=f"sentence-transformers modules.json in {model_path}")


def read_text_settings(model_path: str) -> TextSettings:
    """Max length, lower-casing and prompts from the folder's sentence-transformers files;
    defaults for a folder without them."""
    folder = Path(model_path)
    bert_config = _read_json(folder / "sentence_bert_config.json") or {}
    st_config = _read_json(folder / "config_sentence_transformers.json") or {}
    prompts = st_config.get("prompts") or {}
    default_prompt_name = st_config.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise UsageError(f"{folder / 'config_sentence_transformers.json'}: default_prompt_name "
                         f"{default_prompt_name!r} is not one of its prompts ({', '.join(prompts) or 'none'})")
    return TextSettings(max_seq_length=bert_config.get("max_seq_length"),
                        lowercase=bool(bert_config.get("do_lower_case", False)), prompts=dict(prompts),
                        default_prompt_name=default_prompt_name)


def resolve_prompt(settings: TextSettings, prompt: str | None, prompt_name: str | None) -> str:
    """The text put before every row, as sentence-transformers picks it: an explicit prompt,
    else the named one, else the folder's default prompt, else none."""
    if prompt is not None and prompt_name is not None:
        raise UsageError("give --prompt or --prompt-name, not both")
    if prompt is not None:
        return prompt
    if prompt_name is not None:
        if prompt_name not in settings.prompts:
            raise UsageError(f"--prompt-name {prompt_name!r} is not a prompt of this model; its prompts: "
                             f"{', '.join(settings.prompts) or 'none (use --prompt TEXT)'}")
        return settings.prompts[prompt_name]
    if settings.default_prompt_name is not None:
        return settings.prompts[settings.default_prompt_name]
    return ""
