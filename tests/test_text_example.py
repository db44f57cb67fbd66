"""The real-text example (recipes/text.yaml) trains through the launcher, scaled down: it learns more
than the byte frequencies of a text the user names, and ends with a sample."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TEXT = ROOT / "recipes/data/shakespeare.txt"


def test_the_shipped_text_is_small_and_its_source_is_cited() -> None:
    assert 100_000 < TEXT.stat().st_size < 1_000_000
    header = (ROOT / "recipes/train_text.py").read_text().split('"""')[1]
    assert "public domain" in header and "karpathy/char-rnn" in header


@pytest.mark.slow
def test_a_scaled_down_run_on_a_named_file_beats_the_unigram_entropy_and_prints_a_sample(tmp_path: Path) -> None:
    text = tmp_path / "book.txt"
    text.write_bytes(TEXT.read_bytes()[:120_000])
    args = (f'args=[--text,"{text}",--layers,"1",--d-model,"32",--heads,"2",--seq-len,"32",--eval-every,"30",'
            '--eval-batches,"4",--sample-bytes,"40",--log-every,"10"]')
    result = subprocess.run(
        [sys.executable, "-m", "zerorun.cli", "launch", str(ROOT / "recipes/text.yaml"), "--set", args,
         "--set", "train.steps=60", "--set", "scheduler.type=none", "--set", "optimizer.lr=1e-2",
         "--set", f"name=text-{tmp_path.name}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "book.txt: 108,000 bytes to train on, 12,000 held out" in out
    entropy = float(re.search(r"unigram entropy ([\d.]+) nats/byte", out).group(1))
    val = [float(x) for x in re.findall(r"validation loss ([\d.]+) nats/byte", out)]
    assert len(val) == 2 and val[1] < val[0] and val[1] < entropy - 0.2, out
    sample = re.findall(r"\[localhost:0\] \| (.*)", out)
    assert sample and sum(len(line) for line in sample) >= 40, out
    assert re.search(r"done: 60 steps, validation loss [\d.]+ against a unigram entropy of", out)
    assert (tmp_path / "runs" / f"text-{tmp_path.name}" / "telemetry.jsonl").is_file()
