"""Write the sample images the page to try it offers (service/static/): two shapes-world scenes, the kind of picture
the demo models were trained on (two, for /nlvr2 and /retrieve), and a natural photo (scikit-image's `astronaut`, NASA, public domain), each < 100 KB.

Usage: python scripts/page_samples.py [OUT_DIR]   (default: service/static)
"""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a source checkout

from training.data.shapes_world import WorldConfig, generate_scene, render_scene  # noqa: E402

SCENES = {"sample-shapes.png": ("test", 0), "sample-shapes-2.png": ("test", 4)}  # held-out scenes, 4 objects each


def main(out: Path) -> None:
    import skimage.data

    out.mkdir(parents=True, exist_ok=True)
    for name, (split, index) in SCENES.items():
        Image.fromarray(np.asarray(render_scene(generate_scene(WorldConfig(), split, index)))).save(out / name, optimize=True)
    photo = Image.fromarray(skimage.data.astronaut()).resize((320, 320), Image.Resampling.LANCZOS)
    photo.save(out / "sample-photo.jpg", quality=85, optimize=True)
    for path in [out / name for name in SCENES] + [out / "sample-photo.jpg"]:
        size = path.stat().st_size
        assert size < 100_000, f"{path} is {size} bytes"
        print(f"{path}: {size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "service" / "static")
