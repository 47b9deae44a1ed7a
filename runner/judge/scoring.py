"""Image quality: PSNR/SSIM against a baseline and structural sanity (the seed's fp8 collapse was ~97%
transparent RGBA and grey RGB at 7-9 dB: an image that decodes is not yet an image that is right)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from skimage.metrics import structural_similarity

from runner.core.records import Sanity, Scores

PSNR_CAP_DB = 100.0


def decode(png: bytes, max_pixels: int | None = None) -> Image.Image:
    """The image, decoded; with `max_pixels`, an image declaring more pixels is refused before it is
    decoded (the header says its size: the pixels are never allocated)."""
    image = Image.open(io.BytesIO(png))
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise ValueError(f"image declares {image.width}x{image.height} pixels, over the cap of {max_pixels} "
                         "pixels (4× the requested size); not decoded")
    image.load()
    return image


def sanity(image: Image.Image, *, max_transparent_share: float = 0.5, min_pixel_std: float = 2.0,
           expected_size: tuple[int, int] | None = None, baseline_size: tuple[int, int] | None = None) -> Sanity:
    """Structural checks; a size other than the one requested (or the baseline's) is broken output: the
    server ignored the request, and the image cannot be compared."""
    alpha_share = 0.0
    if "A" in image.getbands():
        alpha = np.asarray(image.getchannel("A"))
        alpha_share = float(np.mean(alpha == 0))
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    std = float(rgb.std())
    nan_or_black = bool(not np.isfinite(rgb).all() or rgb.max() <= 1.0)
    reasons = []
    if expected_size is not None and image.size != tuple(expected_size):
        reasons.append(f"image is {image.width}x{image.height}, requested {expected_size[0]}x{expected_size[1]}")
    elif baseline_size is not None and image.size != tuple(baseline_size):
        reasons.append(f"image is {image.width}x{image.height}, baseline is {baseline_size[0]}x{baseline_size[1]}")
    if alpha_share > max_transparent_share:
        reasons.append(f"{alpha_share:.0%} of pixels fully transparent")
    if nan_or_black:
        reasons.append("image is black (or NaN)")
    elif std < min_pixel_std:
        reasons.append(f"image is flat (pixel std {std:.2f} < {min_pixel_std:g})")
    return Sanity(width=image.width, height=image.height, mode=image.mode, transparent_share=alpha_share,
                  pixel_std=std, nan_or_black=nan_or_black, broken=bool(reasons), reasons=tuple(reasons))


def _rgb(image: Image.Image) -> np.ndarray:
    # Composite onto black so a transparent image scores as what a viewer would see, not its hidden RGB.
    if "A" in image.getbands():
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float64)
        return rgba[..., :3] * (rgba[..., 3:4] / 255.0)
    return np.asarray(image.convert("RGB"), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two 8-bit images (any integer or float arrays); inf when identical."""
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


def score(image: Image.Image, baseline: Image.Image | None, baseline_name: str | None, *,
          max_transparent_share: float = 0.5, min_pixel_std: float = 2.0,
          expected_size: tuple[int, int] | None = None) -> Scores:
    checks = sanity(image, max_transparent_share=max_transparent_share, min_pixel_std=min_pixel_std,
                    expected_size=expected_size, baseline_size=baseline.size if baseline is not None else None)
    if baseline is None:
        return Scores(baseline=baseline_name, psnr_db=None, ssim=None, size_match=None,
                      reason="no baseline image for this fixture and seed", sanity=checks)
    if baseline.size != image.size:
        # Compared only after an explicit resize would hide a wrong-size bug: report the mismatch instead.
        return Scores(baseline=baseline_name, psnr_db=None, ssim=None, size_match=False,
                      reason=f"size mismatch: image {image.width}x{image.height}, baseline "
                      f"{baseline.width}x{baseline.height}", sanity=checks)
    a, b = _rgb(image), _rgb(baseline)
    value = psnr(a, b)
    ssim = float(structural_similarity(a, b, channel_axis=2, data_range=255.0))
    identical = value == float("inf")
    # JSON has no infinity: identical images are capped at PSNR_CAP_DB and say so.
    return Scores(baseline=baseline_name, psnr_db=PSNR_CAP_DB if identical else round(value, 3), ssim=round(ssim, 5),
                  size_match=True,
                  reason="identical to the baseline" if identical else None, sanity=checks)
