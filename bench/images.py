"""The JPEG requests of the benchmarks: photo-like pictures (smooth, with texture) of a given size,
so that they compress as photos do (about 22 KiB at 224x224) and decode at a photo's cost."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

QUALITY = 90
# ImageNet's normalisation, as image classifiers take their inputs.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def photo_jpeg(texture: np.ndarray) -> bytes:
    """A JPEG of a smooth gradient with `texture` (an HWC or CHW array of values in [0, 1]) over it."""
    pixels = texture.transpose(1, 2, 0) if texture.shape[0] == 3 else texture
    height, width = pixels.shape[:2]
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x / width, y / height, (x + y) / (width + height)], axis=2) * 200 + pixels * 55
    out = io.BytesIO()
    Image.fromarray(smooth.astype(np.uint8)).save(out, "JPEG", quality=QUALITY)
    return out.getvalue()


def image_settings(height: int, width: int) -> dict[str, object]:
    """preprocess.images for an input of 3xHxW float32: resized, CHW, ImageNet's mean and std."""
    return {"resize": [height, width], "layout": "CHW", "dtype": "float32", "mean": list(MEAN), "std": list(STD)}
