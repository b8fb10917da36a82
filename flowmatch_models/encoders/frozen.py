"""The three frozen encoders of the precalc stage, loaded through the real ``from_pretrained``.

- VAE: diffusers ``AutoencoderDC`` (DC-AE f32c32): ``[N, 256, 256, 3] uint8 -> [N, 32, 8, 8]``
  fp16 (any bucket ``H x W``, multiples of 32: ``[N, 32, H/32, W/32]``), the *unscaled* ``.latent`` (multiply by :attr:`Encoders.scaling_factor` for training).
- DINO: transformers ``Dinov2Model`` (dinov2-small): ImageNet-normalised images resized to
  ``dino_size``; the last hidden state's patch tokens mapped to the 8x8 latent grid
  (``avg2x2``: 224 px -> 16x16 patches -> 2x2 average pool; ``resize112``: run at 112 px, 8x8
  patches directly) -> ``patch [N, 64, 384]`` and ``cls [N, 384]`` fp16; a bucket runs at the
  same pixels per latent cell and pools onto its own grid (``[N, (H/32)(W/32), 384]``).
- Text: ``AutoTokenizer`` + ``AutoModel`` (``Gemma3TextModel`` for gemma-3-270m): last hidden
  states of the caption truncated to ``max_tokens`` tokens (BOS included), only the valid
  tokens -> ragged ``tokens [T, 640]`` fp16 + ``lengths [N] int32``. An empty caption still
  yields one token (BOS), so every sample has length >= 1. Gemma's activations overflow fp16,
  so the text encoder computes in bf16 or fp32 only (``text_dtype``; fp16 is refused); values
  beyond the fp16 range are clamped when stored and counted (:attr:`Encoders.text_saturated`).
  :meth:`Encoders.encode_null` gives the encoded empty prompt: the null caption for CFG.

Each model is given as a hub id or a local folder. Loading is lazy (first use). With
``HF_HUB_OFFLINE=1`` only the local HF cache is consulted. Missing weights raise
:class:`MissingWeightsError` naming the model, where it looked and how to fix it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flowmatch_models.data.buckets import GRID
from flowmatch_models.encoders.loading import (
    load_identified,
    load_pretrained,
    own_memory,
    resolve_device,
    resolve_dtype,
)
from flowmatch_models.encoders.spec import EncoderSpec, simulated_rate
from flowmatch_models.encoders.zoo import is_random_weights
from flowmatch_models.storage.fingerprint import dtype_name

IMAGENET_MEAN = (0.485, 0.456, 0.406)

IMAGENET_STD = (0.229, 0.224, 0.225)

IMAGE_SIZE = 256

LATENT_GRID = IMAGE_SIZE // GRID  # the latent grid of a 256 px square: 8 cells a side

DINO_POOLS = ("avg2x2", "resize112")

FP16_MAX = 65504.0

#: ``flowmatch bench precompute`` only (:data:`~flowmatch_models.encoders.spec.SIMULATE_ENV`):
#: each encoder still loads its model (``from_pretrained``), tokenizes and checks its inputs,
#: but its forward pass is replaced by a sleep of its share of a pair's time on the simulated
#: GPU and arrays of the real shapes and dtype (noise): everything around the forward passes
#: runs for real. The shards say so in their fingerprint and attrs.
#: each encoder's share of a pair's FLOPs (ARCHITECTURE.md: DC-AE f32c32 ~324 G at 256 px,
#: DINOv2-small ~11 G at 224 px, Gemma3-270M ~26 G at 128 tokens)
#: one tokenizer call at a time in this process: a fast tokenizer sets its truncation state per
#: call (concurrent calls fail with "Already borrowed"), and the precalc tokenizes the next
#: partition's captions on a thread while this one's are encoded
_TOKENIZE_LOCK = threading.Lock()

SIMULATED_SHARE = {"vae": 324 / 361, "dino": 11 / 361, "text": 26 / 361}


class Encoders:
    """Lazily loaded VAE, DINOv2 and text encoder with batched, inference-mode encode methods."""

    def __init__(self, spec: EncoderSpec | None = None):
        self.spec = spec or EncoderSpec()
        if self.spec.dino_pool not in DINO_POOLS:
            raise ValueError(f"dino_pool {self.spec.dino_pool!r}; choose one of {DINO_POOLS}")
        self._device = resolve_device(self.spec.device)
        self.dtype = resolve_dtype(self.spec.dtype, self._device)
        self.text_dtype = resolve_dtype(self.spec.text_dtype, self._device)
        if self.text_dtype == torch.float16:
            raise ValueError(
                "text_dtype fp16: Gemma3's hidden states overflow fp16 (values beyond 65504 become "
                "inf); compute the text encoder in bf16 or fp32 (text_dtype: bf16 | fp32 | auto). "
                "Its outputs are still stored as fp16, clamped and counted."
            )
        self.text_saturated = 0  # caption values clamped to the fp16 range so far
        self.simulated_pairs_per_s = simulated_rate()
        #: where weight hashes are remembered between processes (set by the precalc)
        self.weights_cache: Any = None
        #: per role, the identity of the weights its model was loaded from (taken at the load:
        #: :func:`~flowmatch_models.encoders.loading.load_identified`), what a fingerprint names
        self.weights: dict[str, dict] = {}
        self._vae: Any = None
        self._dino: Any = None
        self._text: Any = None
        self._tokenizer: Any = None
        self._tokenizer_given = False  # from_models: kept when the text model loads

    @classmethod
    def from_models(
        cls,
        spec: EncoderSpec | None = None,
        *,
        vae: Any = None,
        dino: Any = None,
        text: Any = None,
        tokenizer: Any = None,
    ) -> Encoders:
        """Encoders around already built models (benchmarks, notebooks); the rest load lazily.

        Models are moved to the spec's device/dtype and prepared exactly as loaded ones are.
        """
        enc = cls(spec)

        def cast(model: Any) -> Any:
            return model if next(model.parameters()).dtype == enc.dtype else model.to(enc.dtype)

        if vae is not None:
            enc._vae = enc._prepare_vae(cast(vae))
        if dino is not None:
            enc._dino = enc._prepare(cast(dino), compile_it=True)
        if text is not None:
            if next(text.parameters()).dtype != enc.text_dtype:
                text = text.to(enc.text_dtype)
            enc._text = enc._prepare(text, compile_it=False)
        enc._tokenizer = tokenizer
        enc._tokenizer_given = tokenizer is not None
        return enc

    def _compiling(self) -> bool:
        return self.spec.compile and self._device.type == "cuda"

    def compute(self, role: str) -> dict:
        """The resolved compute dtype and device class of ``role``'s encoder, as a fingerprint
        records them: ``{"compute_dtype": "bf16", "device": "cuda"}``."""
        dtype = self.text_dtype if role == "text" else self.dtype
        return {"compute_dtype": dtype_name(dtype), "device": self._device.type}

    def _identified(self, role: str, load: Callable[[], Any]) -> Any:
        """``load()`` of ``role``'s model with the identity of the weights it read
        (:attr:`weights`)."""
        got, self.weights[role] = load_identified(
            getattr(self.spec, role), load, self.weights_cache
        )
        return got

    def _prepare(self, model: Any, compile_it: bool) -> Any:
        model = own_memory(model.to(self._device)).eval().requires_grad_(False)
        return torch.compile(model) if compile_it and self._compiling() else model

    def _prepare_vae(self, vae: Any) -> Any:
        vae = own_memory(vae.to(self._device)).eval().requires_grad_(False)
        if self.spec.channels_last and self._device.type == "cuda":
            vae = vae.to(memory_format=torch.channels_last)
        if self._compiling():
            vae.encoder = torch.compile(vae.encoder)
        return vae

    def load(self, role: str) -> None:
        """Load ``role``'s model now (``vae``, ``dino``, or ``text`` with its tokenizer), on
        this thread: the lazy imports of diffusers and transformers are not safe to race."""
        if role == "text":
            _ = self.text_model  # its tokenizer with it: one version of the folder
        else:
            getattr(self, role)

    # ---------------------------------------------------------------------------------- props
    @property
    def device(self) -> str:
        """The torch device the encoders run on, e.g. ``"cpu"`` or ``"cuda"``."""
        return str(self._device)

    @property
    def random_weights(self) -> dict[str, bool]:
        """Per encoder: True where its folder is a zoo model (randomly initialised)."""
        return {k: is_random_weights(getattr(self.spec, k)) for k in ("vae", "dino", "text")}

    @property
    def scaling_factor(self) -> float:
        """DC-AE latent scaling factor from the VAE config (0.41407 for f32c32-sana-1.0)."""
        return float(self.vae.config.scaling_factor)

    @property
    def vae(self) -> Any:
        """The ``AutoencoderDC`` (loaded on first use)."""
        if self._vae is None:
            from diffusers import AutoencoderDC

            self._vae = self._identified(
                "vae",
                lambda: self._prepare_vae(
                    load_pretrained(
                        "vae", self.spec.vae, AutoencoderDC.from_pretrained, torch_dtype=self.dtype
                    )
                ),
            )
        return self._vae

    @property
    def dino(self) -> Any:
        """The DINOv2 model (loaded on first use)."""
        if self._dino is None:
            from transformers import AutoModel

            self._dino = self._identified(
                "dino",
                lambda: self._prepare(
                    load_pretrained(
                        "dino", self.spec.dino, AutoModel.from_pretrained, dtype=self.dtype
                    ),
                    compile_it=True,
                ),
            )
        return self._dino

    @property
    def text_model(self) -> Any:
        """The text encoder (``Gemma3TextModel`` for gemma-3-270m; loaded on first use)."""
        if self._text is None:
            self._load_text()
        return self._text

    @property
    def tokenizer(self) -> Any:
        """The caption tokenizer (loaded on first use: alone, where only it is needed; with the
        text model, :meth:`load`, the two from one version of the folder)."""
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return load_pretrained("text", self.spec.text, AutoTokenizer.from_pretrained)

    def _load_text(self) -> None:
        from transformers import AutoModel

        def load() -> tuple[Any, Any]:  # a tokenizer from_models was given is kept
            tok = self._tokenizer if self._tokenizer_given else self._load_tokenizer()
            model = load_pretrained(
                "text", self.spec.text, AutoModel.from_pretrained, dtype=self.text_dtype
            )
            return tok, self._prepare(model, compile_it=False)

        self._tokenizer, self._text = self._identified("text", load)

    # --------------------------------------------------------------------------------- images
    def _batches(self, n: int) -> list[slice]:
        bs = max(1, int(self.spec.batch_size))
        return [slice(i, min(i + bs, n)) for i in range(0, n, bs)]

    def _images_to_tensor(self, images: np.ndarray) -> torch.Tensor:
        """uint8 NHWC -> float NCHW in [0, 1] on the device."""
        t = torch.from_numpy(np.ascontiguousarray(images)).to(self._device, non_blocking=True)
        return t.permute(0, 3, 1, 2).float().div_(255.0)

    @staticmethod
    def _check_images(images: np.ndarray) -> np.ndarray:
        """uint8 ``[N, H, W, 3]`` of one size, H and W multiples of the 32-pixel latent cell
        (256 x 256, or an aspect-ratio bucket)."""
        images = np.asarray(images)
        if (
            images.dtype != np.uint8
            or images.ndim != 4
            or images.shape[3] != 3
            or images.shape[1] % GRID
            or images.shape[2] % GRID
        ):
            raise ValueError(
                f"expected uint8 images [N, H, W, 3] with H and W multiples of {GRID} (256 x 256 "
                f"or an aspect-ratio bucket), got {images.dtype} {images.shape}"
            )
        return images

    @torch.inference_mode()
    def encode_vae(self, images_uint8: np.ndarray) -> np.ndarray:
        """DC-AE latents ``[N, 32, H/32, W/32]`` fp16 (unscaled) of uint8 images ``[N, H, W, 3]``
        (``[N, 32, 8, 8]`` at 256 x 256)."""
        images = self._check_images(images_uint8)
        vae = self.vae
        if self.simulated_pairs_per_s:
            c = int(vae.config.latent_channels)
            shape = (len(images), c, images.shape[1] // GRID, images.shape[2] // GRID)
            return self._simulated("vae", len(images), shape)
        out = []
        for sl in self._batches(len(images)):
            x = self._images_to_tensor(images[sl]).mul_(2.0).sub_(1.0).to(self.dtype)
            if self.spec.channels_last and self._device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            out.append(_to_fp16(vae.encode(x).latent))
        if not out:
            c = int(vae.config.latent_channels)
            return np.zeros((0, c, images.shape[1] // GRID, images.shape[2] // GRID), np.float16)
        return np.concatenate(out)

    @property
    def dino_input_size(self) -> int:
        """Pixel size DINOv2 runs at for 256 x 256 images (``dino_size``, or 112 for
        ``resize112``); a bucket's is :meth:`dino_input_hw`."""
        patch = int(self.dino.config.patch_size)
        size = patch * LATENT_GRID if self.spec.dino_pool == "resize112" else self.spec.dino_size
        grid = size // patch
        if size % patch or grid % LATENT_GRID:
            raise ValueError(
                f"dino_size {size} gives a {size / patch:g}-patch grid with patch {patch}; it "
                f"must be a multiple of {LATENT_GRID} patches (e.g. 224 for patch 14)"
            )
        return size

    def dino_input_hw(self, height: int, width: int) -> tuple[int, int]:
        """Pixels DINOv2 runs at for images of ``height x width``: the same pixels per latent
        cell as at 256 x 256 (224 px -> 28 a cell, 2 x 2 patches of 14), so that its patch grid
        pools evenly onto the ``(H/32) x (W/32)`` latent grid (HF Dinov2 interpolates its
        position embedding to any grid)."""
        per_cell = self.dino_input_size // LATENT_GRID
        return height // GRID * per_cell, width // GRID * per_cell

    @torch.inference_mode()
    def encode_dino(self, images_uint8: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """DINOv2 features of uint8 images ``[N, H, W, 3]``: ``(patch [N, (H/32)(W/32), D],
        cls [N, D])`` fp16, D = 384, the patches pooled onto the latent grid in row-major order
        (``[N, 64, D]`` at 256 x 256)."""
        images = self._check_images(images_uint8)
        dino = self.dino
        gh, gw = images.shape[1] // GRID, images.shape[2] // GRID  # the latent grid
        size = self.dino_input_hw(images.shape[1], images.shape[2])
        ph, pw = (s // int(dino.config.patch_size) for s in size)
        if self.simulated_pairs_per_s:
            d = int(dino.config.hidden_size)
            patch = self._simulated("dino", len(images), (len(images), gh * gw, d))
            return patch, _noise((len(images), d))
        mean = torch.tensor(IMAGENET_MEAN, device=self._device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=self._device).view(1, 3, 1, 1)
        patches, clss = [], []
        for sl in self._batches(len(images)):
            x = self._images_to_tensor(images[sl])
            if size != tuple(images.shape[1:3]):
                x = F.interpolate(x, size=size, mode="bicubic", antialias=True)
            x = ((x - mean) / std).to(self.dtype)
            h = dino(pixel_values=x).last_hidden_state  # [B, 1 + registers + ph*pw, D]
            cls = h[:, 0]
            p = h[:, -ph * pw :].float()
            b, _, d = p.shape
            if (ph, pw) != (gh, gw):
                p = p.transpose(1, 2).reshape(b, d, ph, pw)
                p = F.adaptive_avg_pool2d(p, (gh, gw)).reshape(b, d, -1).transpose(1, 2)
            patches.append(_to_fp16(p))
            clss.append(_to_fp16(cls))
        if not patches:
            d = int(dino.config.hidden_size)
            return np.zeros((0, gh * gw, d), np.float16), np.zeros((0, d), np.float16)
        return np.concatenate(patches), np.concatenate(clss)

    # ----------------------------------------------------------------------------------- text
    def tokenize(self, captions: Sequence[str]) -> list[list[int]]:
        """Token ids per caption, exactly as :meth:`encode_text` feeds them (truncated, BOS).

        Captions are lower-cased and stripped as ``SanaPipeline`` does to prompts
        (``_text_preprocessing`` without ``clean_caption``), so an exported pipeline encodes a
        prompt exactly as training encoded the captions."""
        with _TOKENIZE_LOCK:  # a fast tokenizer's truncation state is not thread-safe
            enc = self.tokenizer(
                [_clean_caption(c).lower() for c in captions],
                truncation=True,
                max_length=self.spec.max_tokens,
                add_special_tokens=True,
            )
        ids = [list(x) for x in enc["input_ids"]]
        bos = self.tokenizer.bos_token_id
        # every sample keeps >= 1 token: tokenizers that add no BOS get one for empty captions
        return [x if x else [bos if bos is not None else self.tokenizer.pad_token_id] for x in ids]

    def token_counts(self, captions: Sequence[str]) -> np.ndarray:
        """Tokens per caption as :meth:`tokenize` sees it, *before* truncation (a count above
        ``max_tokens`` is a caption the text embeddings cut short)."""
        with _TOKENIZE_LOCK:
            enc = self.tokenizer(
                [_clean_caption(c).lower() for c in captions], add_special_tokens=True
            )
        return np.array([max(1, len(x)) for x in enc["input_ids"]], dtype=np.int32)

    @torch.inference_mode()
    def encode_text(
        self, captions: Sequence[str], token_ids: Sequence[list[int]] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Last hidden states of the valid caption tokens: ``(tokens [T, D], lengths [N] int32)``.

        Captions are truncated to ``max_tokens`` tokens; empty/whitespace captions give the BOS
        token only (length 1). Batches are sorted by length so padding stays small.
        ``token_ids``: the captions' :meth:`tokenize`, when done ahead (on another thread).
        """
        ids = (
            [list(x) for x in token_ids] if token_ids is not None else self.tokenize(list(captions))
        )
        if len(ids) != len(captions):
            raise ValueError(f"{len(captions)} captions but {len(ids)} token id lists")
        lengths = np.array([len(x) for x in ids], dtype=np.int32)
        model = self.text_model
        hidden = int(model.config.hidden_size)
        if self.simulated_pairs_per_s:
            return self._simulated("text", len(ids), (int(lengths.sum()), hidden)), lengths
        pad = self.tokenizer.pad_token_id or 0
        order = np.argsort(-lengths, kind="stable")
        per_sample: list[np.ndarray | None] = [None] * len(ids)
        for sl in self._batches(len(ids)):
            idx = order[sl]
            L = int(lengths[idx].max())
            input_ids = torch.full((len(idx), L), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), L), dtype=torch.long)
            for row, i in enumerate(idx):
                input_ids[row, : lengths[i]] = torch.tensor(ids[i])
                mask[row, : lengths[i]] = 1
            h = model(
                input_ids=input_ids.to(self._device), attention_mask=mask.to(self._device)
            ).last_hidden_state
            valid = mask.to(h.device, torch.bool)[..., None]
            self.text_saturated += int(((h.float().abs() > FP16_MAX) & valid).sum())
            h16 = _to_fp16(h)
            for row, i in enumerate(idx):
                per_sample[i] = h16[row, : lengths[i]]
        if not ids:
            return np.zeros((0, hidden), np.float16), lengths
        return np.concatenate(per_sample), lengths  # type: ignore[arg-type]

    def _simulated(self, role: str, pairs: int, shape: tuple[int, ...]) -> np.ndarray:
        """The simulated forward pass (:data:`SIMULATE_ENV`): its share of ``pairs`` pairs'
        time on the simulated GPU, then fp16 noise of ``shape``."""
        time.sleep(pairs * SIMULATED_SHARE[role] / float(self.simulated_pairs_per_s or 1))
        return _noise(shape)

    def encode_null(self) -> np.ndarray:
        """The encoded empty prompt ``[L0, D]`` fp16 (Gemma: the BOS token's state): the null
        caption of caption dropout and CFG, and SanaPipeline's default negative prompt."""
        saturated = self.text_saturated
        tokens, _ = self.encode_text([""])
        self.text_saturated = saturated  # the null caption is not a sample
        return tokens


_NOISE: np.ndarray | None = None


def _noise(shape: tuple[int, ...]) -> np.ndarray:
    """fp16 N(0, 1) noise of ``shape``, cut from one pool made once (a simulation's arrays cost
    a copy, not a random draw per value)."""
    global _NOISE
    if _NOISE is None:
        _NOISE = (
            np.random.default_rng(0).standard_normal(1 << 22, dtype=np.float32).astype(np.float16)
        )
    size = int(np.prod(shape))
    start = (size * 7919) % len(_NOISE)  # varies with the shape, deterministic
    return np.resize(_NOISE[start:], size).reshape(shape)


def _clean_caption(caption: Any) -> str:
    """Captions as text: None/NaN -> "", surrogates and NULs removed, whitespace stripped."""
    if caption is None or (isinstance(caption, float) and caption != caption):
        return ""
    text = str(caption).replace("\x00", "")
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text.strip()


def _to_fp16(t: torch.Tensor) -> np.ndarray:
    """Float tensor -> fp16 numpy, saturating at the fp16 range instead of overflowing to inf."""
    return t.float().clamp_(-FP16_MAX, FP16_MAX).to(torch.float16).cpu().numpy()


@torch.inference_mode()
def decode_latents(
    vae: Any, latents: np.ndarray | torch.Tensor, batch_size: int = 32
) -> np.ndarray:
    """Decode unscaled DC-AE latents ``[N, 32, 8, 8]`` to uint8 images ``[N, 256, 256, 3]``."""
    param = next(vae.parameters())
    z = torch.as_tensor(np.asarray(latents) if not torch.is_tensor(latents) else latents)
    out = []
    for i in range(0, len(z), batch_size):
        x = vae.decode(z[i : i + batch_size].to(param.device, param.dtype)).sample
        x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        out.append(x.permute(0, 2, 3, 1).cpu().numpy())
    if not out:
        return np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    return np.concatenate(out)
