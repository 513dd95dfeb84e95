"""benchmarks/finetune.py: the checkpoint it pretrains by default, and nothing recorded when its job is stopped."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import load_benchmark

from tasks.jobs import world


def test_a_sigterm_to_the_pretraining_job_stops_the_benchmark(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The job checkpoints and returns on SIGTERM, as a scheduler's preemption wants; the benchmark must
    # then stop, not fine-tune and record from the unfinished checkpoint.
    module = load_benchmark("finetune.py", "finetune_benchmark", monkeypatch)
    stops_after = world.Preempted.stops_after

    def signalled_at_step_2(self: world.Preempted, step: int, stop: int) -> bool:
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, to the job's own handler
        return stops_after(self, step, stop)

    monkeypatch.setattr(world.Preempted, "stops_after", signalled_at_step_2)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="the pretraining job was stopped at step 2; nothing recorded"):
            module.pretrained_checkpoint(tmp_path, "tiny", 20)
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_the_default_pretraining_gives_a_checkpoint_and_says_what_it_is(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default --pretrain (tiny, on the demo's sample, whose val split is shorter than a row: no
    # validation figure) failed formatting the missing figure after the job had run.
    module = load_benchmark("finetune.py", "finetune_benchmark", monkeypatch)
    checkpoint, what, _ = module.pretrained_checkpoint(tmp_path, "tiny", 3)
    assert Path(checkpoint).name == "step-0000003"
    assert what.startswith(
        "tiny, pretrained here for 3 steps of 16 × 64 bytes on the demo's generated sample"
    )


def test_a_setting_the_command_refuses_is_refused_by_its_flag_before_any_pretraining(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load_benchmark("finetune.py", "finetune_benchmark", monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        module.main(["--lm-lr-factor", "2"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--lm-lr-factor 2.0: Input should be less than or equal to 1" in err
    assert "pretraining" not in err


def test_the_defaults_are_chosen_on_dev_with_the_test_split_read_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first selection's log had F highest on dev and G, chosen, highest on test: on dev alone, F.
    module = load_benchmark("finetune_select.py", "finetune_select_benchmark", monkeypatch)
    assert module.choose_on_dev({"D": 0.567, "E": 0.545, "F": 0.619, "G": 0.617, "H": 0.541}) == "F"
    assert module.choose_on_dev({"D": 0.60, "E": 0.62, "F": 0.62}) == "E"  # a tie: the first listed

    from tasks.transfer.datasets import load_dataset

    folder = tmp_path / "sst"
    folder.mkdir()
    for split, count in (("train", 6), ("dev", 4), ("test", 4)):
        rows = "".join(f"{split} sentence {i},{i % 2}\n" for i in range(count))
        (folder / f"{split}.csv").write_text("text,label\n" + rows)
    spec, counts = module.hide_test(f"sst={folder}", 4, tmp_path / "hidden")
    hidden = load_dataset(spec)
    assert counts == {"train": 4, "dev": 4} and len(hidden.train) == 4
    assert hidden.test.texts == hidden.dev.texts and list(hidden.test.labels) == list(hidden.dev.labels)
    every = [text for split in hidden.splits().values() for text in split.texts]
    assert not [text for text in every if text.startswith("test")]
