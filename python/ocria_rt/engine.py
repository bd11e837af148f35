"""The Python face of the engine: text or token ids in, tokens or text out."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

from . import _core
from .errors import FileError, InvalidArgumentError, ModelError
from .preprocess import _read_json

Prompt = str | Sequence[int] | np.ndarray


@dataclass
class GenerationResult:
    """What generate() returns. Timings are wall-clock seconds measured by the engine."""

    token_ids: list[int]
    text: str | None
    finish_reason: str  # "length", "stop" or "cancelled"
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: dict[str, object] = field(default_factory=dict)
    # Speculative decoding: tokens each verify step contributed (accepted drafts + 1; the last step's
    # cut by a stop token or max_new_tokens). Empty without a drafter or with speculative=False.
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step (tau); 0 without speculative decoding."""
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes from the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def _default_drafter(model_dir: Path, device: str) -> Path | None:
    """The model directory's own drafter/ where it is on by default: on the devices (by kind: "cpu",
    "cuda") that its config.json lists in "ocria_rt": {"default_devices": [...]}, else on every one."""
    config_path = model_dir / "drafter" / "config.json"
    if not config_path.is_file():
        return None
    config = _read_json(config_path)
    section = config.get("ocria_rt", {}) if isinstance(config, dict) else {}
    if not isinstance(section, dict):
        raise ModelError(f'{config_path}: "ocria_rt" must be an object such as {{"default_devices": ["cuda"]}}, '
                         f'got {section!r}')
    devices = section.get("default_devices")
    if devices is None:
        return config_path.parent
    if not (isinstance(devices, list) and all(isinstance(d, str) for d in devices)):
        raise ModelError(f'{config_path}: "ocria_rt": {{"default_devices": ...}} must be a list of device '
                         f'kinds such as ["cuda"], got {devices!r}')
    return config_path.parent if device.split(":")[0] in devices else None


class Engine:
    """A Qwen3.5 text model loaded on one device.

    >>> eng = ocria_rt.Engine()                      # the small model shipped in the package, on the CPU
    >>> eng.chat([{"role": "user", "content": [{"type": "image", "image": "page.png"}]}]).text

    drafter: a DFlash / DFlash2 drafter directory (z-lab's format) trained for this model: generation
    then drafts blocks and verifies them with the model (speculative decoding), with the same tokens
    (greedy; on CUDA up to near ties of the two best logits, which BF16 rounding can order differently
    in a verify step and a decode step) or the same distribution (sampling) as without it. None: the
    model directory's own `drafter/` subdirectory when it has one and is on by default on this device
    (its config.json's "ocria_rt": {"default_devices": ["cuda", ...]}, where it was measured to pay;
    every device without that list); False: none.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        device: str = "cpu",
        *,
        max_context: int = 0,
        prefill_chunk: int = 0,
        num_threads: int = 0,
        cuda_graphs: bool = True,
        max_image_patches: int = 16384,
        drafter: str | os.PathLike[str] | bool | None = None,
        linear_observer: bool = False,
        benchmark_forced_acceptance: int = 0,
        benchmark_phase_timing: bool = False,
    ) -> None:
        """linear_observer: for calibration (ocria_rt.quantize), pass the ops through an observer so that
        observe_linear_inputs() can collect statistics of the decoder's projection inputs (such an engine
        replays no CUDA graphs).

        For benchmarks only (both need a drafter): benchmark_forced_acceptance=tau makes every
        speculative step emit exactly tau tokens, the first tau - 1 drafts as if accepted and then the
        model's own token after them. NOT lossless (the output is no longer the model's): it times steps
        at a chosen acceptance length. benchmark_phase_timing times each step's draft, verify and commit
        phases with device events (stats(): speculative_*_seconds, timed_speculative_steps)."""
        from . import default_model_dir

        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        if drafter is None:
            drafter = _default_drafter(self.model_dir, device)
        elif drafter is False:
            drafter = None
        elif drafter is True:
            raise InvalidArgumentError("drafter must be a directory, None (the model's own drafter/) or False")
        self._core = _core.Engine(
            str(self.model_dir),
            device=device,
            max_context=max_context,
            prefill_chunk=prefill_chunk,
            num_threads=num_threads,
            cuda_graphs=cuda_graphs,
            max_image_patches=max_image_patches,
            drafter="" if drafter is None else str(drafter),
            linear_observer=linear_observer,
            benchmark_forced_acceptance=benchmark_forced_acceptance,
            benchmark_phase_timing=benchmark_phase_timing,
        )
        self.drafter_dir = Path(drafter) if drafter is not None else None
        self.device = device
        self.config: dict[str, Any] = self._core.config
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids: list[int] = _eos_token_ids(self.model_dir, self.config)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_context(self) -> int:
        return int(self._core.max_context)

    def stats(self) -> dict[str, object]:
        """Device, backend and memory: weight_bytes (weight_bytes_by_format splits them into "dense",
        "fp8" and "nvfp4", a quantized linear's scales counted with it), state_bytes, workspace_bytes;
        quantization ("none", "modelopt" or "compressed-tensors"); launches and kernels per decode step and
        per speculative step (once captured); with a drafter its block size and bytes, and the phase times
        of benchmark_phase_timing."""
        return dict(self._core.stats())

    # ---- tokens <-> text ----
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise FileError(f"model directory '{self.model_dir}' has no tokenizer.json: pass token ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise FileError(f"model directory '{self.model_dir}' has no tokenizer.json: cannot decode to text")
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        ids = np.asarray(prompt)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise InvalidArgumentError(f"token ids must be a 1-D sequence of integers, got shape {ids.shape} of {ids.dtype}")
        if ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31):
            raise InvalidArgumentError("token ids must fit in int32")
        return [int(t) for t in ids]

    # ---- images ----
    def encode_images(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
        """The vision encoder's merged output (np.float32 [patches / merge^2, hidden]) for images as
        ocria_rt.preprocess_image (or transformers' processor) returns them."""
        return self._core.encode_images(np.asarray(pixel_values, np.float32), np.asarray(image_grid_thw, np.int64))

    # ---- scoring and generation ----
    def score(
        self,
        prompt: Prompt,
        chunk: int = 0,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
    ) -> np.ndarray:
        """Logits (np.float32 [len(tokens), vocab]) at every position of a fresh sequence.

        chunk: tokens per forward pass (0: the engine's prefill chunk; 1: token by token, the decode path).
        pixel_values / image_grid_thw (VLMs): the images, as preprocess_image(s) returns them, whose
        features fill the runs of image tokens in the prompt, in order (as transformers' forward).
        """
        return self._core.score(self._ids(prompt), int(chunk), *_images(pixel_values, image_grid_thw))

    def hidden_states(
        self,
        prompt: Prompt,
        layers: Sequence[int],
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
    ) -> np.ndarray:
        """The hidden states (np.float32 [len(tokens), len(layers) * hidden]) at every position of a fresh
        sequence after the decoder layers `layers` (from 0; the last layer's after the final norm, as
        transformers' hidden_states[id + 1]), layer layers[i] in columns [i * hidden, (i + 1) * hidden):
        the taps a DFlash drafter reads, in its layout. Images as in score()."""
        return self._core.hidden_states(self._ids(prompt), [int(layer) for layer in layers],
                                        *_images(pixel_values, image_grid_thw))

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
        speculative: bool = True,
    ) -> GenerationResult:
        """Generates up to max_new_tokens tokens after `prompt` (text or token ids).

        temperature 0 is greedy. stop_token_ids=None stops at the model's end-of-sequence tokens;
        pass [] to never stop early. speculative=False decodes without the drafter for this call.
        """
        ids = self._ids(prompt)
        stops = self._stops(stop_token_ids)
        r = self._core.generate(ids, int(max_new_tokens), float(temperature), int(top_k), float(top_p), _seed(seed), stops,
                                *_images(pixel_values, image_grid_thw), speculative=bool(speculative))
        tokens = list(r.token_ids)
        return GenerationResult(
            token_ids=tokens,
            text=self.decode(tokens) if self.tokenizer is not None else None,
            finish_reason=r.finish_reason,
            prompt_tokens=r.prompt_tokens,
            prefill_seconds=r.prefill_seconds,
            decode_seconds=r.decode_seconds,
            stats=self.stats(),
            acceptance_lengths=list(r.acceptance_lengths),
        )

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
        speculative: bool = True,
    ) -> Iterator[int]:
        """Yields new token ids one at a time (same arguments as generate); afterwards
        `acceptance_lengths` holds the speculative steps' acceptance lengths."""
        ids = self._ids(prompt)
        stops = self._stops(stop_token_ids)
        self._core.start(ids, int(max_new_tokens), float(temperature), int(top_k), float(top_p), _seed(seed), stops,
                         *_images(pixel_values, image_grid_thw), speculative=bool(speculative))
        for _ in range(int(max_new_tokens)):
            tok = int(self._core.next_token())
            yield tok
            if tok in stops:
                return

    @property
    def acceptance_lengths(self) -> list[int]:
        """The acceptance lengths of the current or last generation (see GenerationResult)."""
        return list(self._core.acceptance_lengths)

    def draft(self, prompt: Prompt, pixel_values: np.ndarray | None = None,
              image_grid_thw: np.ndarray | None = None) -> list[int]:
        """The drafter's greedy proposals for the first block after `prompt`: the B - 1 tokens it drafts
        after the model's greedy first token (needs a drafter)."""
        return list(self._core.draft(self._ids(prompt), *_images(pixel_values, image_grid_thw)))

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = ..., temperature: float = ...,
             top_k: int = ..., top_p: float = ..., seed: int = ..., stop_token_ids: Sequence[int] | None = ...,
             *, stream: Literal[False] = ..., speculative: bool = ..., **prompt_kwargs: Any) -> GenerationResult: ...
    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int = ..., temperature: float = ...,
             top_k: int = ..., top_p: float = ..., seed: int = ..., stop_token_ids: Sequence[int] | None = ...,
             *, stream: Literal[True], speculative: bool = ..., **prompt_kwargs: Any) -> Iterator[int]: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        *,
        stream: bool = False,
        speculative: bool = True,
        **prompt_kwargs: Any,
    ) -> GenerationResult | Iterator[int]:
        """Answers a conversation: `messages` rendered with the model's chat template (generation prompt
        added), images in them preprocessed and their placeholders expanded (see ocria_rt.chat).

        Returns a GenerationResult whose text has special tokens skipped, or with stream=True an iterator
        of new token ids (as stream()). Extra keyword arguments go to build_multimodal_prompt: its options
        (backend, max_image_pixels) and chat-template variables.
        """
        from .chat import build_multimodal_prompt

        ids, pixel_values, grid = build_multimodal_prompt(self, messages, **prompt_kwargs)
        args = (ids, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, pixel_values, grid, speculative)
        return self.stream(*args) if stream else self.generate(*args)

    # ---- calibration (ocria_rt.quantize) ----
    def linear_groups(self) -> list[dict[str, Any]]:
        """The decoder's projections, layer by layer, then the LM head: for each, "modules" (checkpoint
        module names of the parts fused into it, which read one input), "rows" (each part's outputs),
        "in_features" and "format" ("dense", "fp8" or "nvfp4")."""
        return list(self._core.linear_groups())

    def observe_linear_inputs(self, on: bool, second_moment: bool = False) -> None:
        """Starts (dropping earlier ones) or stops collecting statistics of the inputs of every projection
        over the tokens that score() / generate() run. Needs Engine(..., linear_observer=True)."""
        self._core.observe_linear_inputs(bool(on), bool(second_moment))

    def linear_input_stats(self) -> list[dict[str, Any]]:
        """Per projection of linear_groups(), of its input x [tokens, K] as its checkpoint modules see it
        (times a folded RMSNorm's 1 + w): "tokens", "abs_max" [K], "abs_mean" [K], "square_mean" [K] and,
        when asked for, "second_moment" [K, K] = X^T X / tokens (else None)."""
        return list(self._core.linear_input_stats())

    def set_linear_weight(self, module: str, weight: np.ndarray) -> None:
        """Replaces the weight of dense decoder module `module` in memory by `weight` [out, in] (checkpoint
        layout; a norm folded into the projection at load applies to it too). A float32 C-contiguous array
        is read where it is; another is converted first. See restore_linear_weights."""
        self._core.set_linear_weight(str(module), weight)

    def restore_linear_weights(self) -> None:
        """Puts back every weight set_linear_weight replaced."""
        self._core.restore_linear_weights()

    def keep_reference(self, prompt: Prompt, begin: int, end: int, pixel_values: np.ndarray | None = None,
                       image_grid_thw: np.ndarray | None = None, logits: np.ndarray | None = None) -> int:
        """Keeps, on the engine's device, the logits of rows [begin, end) of the fresh sequence `prompt` (the
        distributions of tokens begin + 1 .. end) with its tokens and its images' encoder output, to measure
        later weights against (reference_kl). logits ([end - begin, vocab], e.g. another engine's
        reference_logits()) are kept instead of computed. Returns the reference's index."""
        return int(self._core.keep_reference(self._ids(prompt), int(begin), int(end),
                                             *_images(pixel_values, image_grid_thw),
                                             None if logits is None else np.asarray(logits, np.float32)))

    def reference_kl(self, index: int) -> np.ndarray:
        """Runs reference `index`'s sequence with the weights as they are now: per kept row, KL(reference ||
        model) of the next-token distributions in nats (np.float64), computed on the device."""
        return self._core.reference_kl(int(index))

    def reference_logits(self, index: int) -> np.ndarray:
        """A reference's kept logits, np.float32 [rows, vocab]."""
        return self._core.reference_logits(int(index))

    def clear_references(self) -> None:
        self._core.clear_references()

    def _stops(self, stop_token_ids: Sequence[int] | None) -> list[int]:
        return list(self.eos_token_ids if stop_token_ids is None else (int(t) for t in stop_token_ids))


def _images(
    pixel_values: np.ndarray | None, image_grid_thw: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    if pixel_values is None and image_grid_thw is None:
        return None, None
    if pixel_values is None or image_grid_thw is None:
        raise InvalidArgumentError("pixel_values and image_grid_thw must be given together")
    return np.asarray(pixel_values, np.float32), np.asarray(image_grid_thw, np.int64)


def _seed(seed: int) -> int:
    if not 0 <= int(seed) < 2**64:
        raise InvalidArgumentError(f"seed must be in [0, 2**64), got {seed}")
    return int(seed)


def _load_tokenizer(model_dir: Path):  # -> tokenizers.Tokenizer | None
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers package raises plain Exceptions
        raise FileError(f"cannot load tokenizer '{path}': {e}") from e


def _eos_token_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    """End-of-sequence ids: generation_config.json first, then config.json (read and checked by the core)."""
    gen = model_dir / "generation_config.json"
    if gen.exists():
        try:
            data = json.loads(gen.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            raise FileError(f"cannot read '{gen}': {e}") from e
        if not isinstance(data, dict):
            raise ModelError(f"'{gen}' must hold a JSON object, got {type(data).__name__}")
        eos = data.get("eos_token_id")
        if eos is not None:
            vocab = int(config["vocab_size"])
            items = eos if isinstance(eos, list) else [eos]
            for i, t in enumerate(items):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    key = f"eos_token_id[{i}]" if isinstance(eos, list) else "eos_token_id"
                    raise ModelError(f"'{gen}': key '{key}' must be a token id in [0, {vocab - 1}], got {t!r}")
            return [int(t) for t in items]
    return [int(t) for t in config.get("eos_token_ids", [])]
