# Owner(s): ["module: moe"]
"""Tests for examples/train_moe_lm.py: smoke run, bit-exact resume, checkpoint failure modes."""

import contextlib
import hashlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_moe_lm

TINY = [
    "--dim", "32", "--layers", "2", "--heads", "2", "--hidden-dim", "32",
    "--experts", "4", "--top-k", "2", "--seq-len", "32", "--batch-size", "4",
    "--corpus-bytes", "20000", "--eval-batches", "1", "--sample-bytes", "0",
    "--warmup", "2", "--no-progress", "--threads", "1",
]  # fmt: skip


def _files(path: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``path``."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


class TestTrainMoELM(TestCase):
    def setUp(self):
        super().setUp()
        self.threads = torch.get_num_threads()
        self.tmp = Path(tempfile.mkdtemp())

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        torch.set_num_threads(self.threads)
        super().tearDown()

    def train(self, out, *args):
        with contextlib.redirect_stdout(io.StringIO()):
            return train_moe_lm.main([*TINY, "--out", str(self.tmp / out), *args])

    def final_params(self, out):
        model, run = train_moe_lm.load_model(self.tmp / out)
        return model.state_dict(), run

    def test_smoke(self):
        r = self.train("smoke", "--steps", "4", "--balance", "aux", "--grad-accum", "2")
        out = self.tmp / "smoke"
        records = [json.loads(line) for line in open(out / "metrics.jsonl")]
        self.assertEqual([rec["step"] for rec in records], [1, 2, 3, 4])
        self.assertEqual(len(records[0]["tokens_per_expert"]), 2)  # one list per layer
        self.assertEqual(sum(records[0]["tokens_per_expert"][0]), 2 * 4 * 32 * 2)  # accum*B*S*K
        self.assertIn("aux_loss", records[0])
        self.assertTrue((out / "train.png").stat().st_size > 0)
        self.assertTrue((out / "checkpoint" / "config.json").exists())
        self.assertTrue(torch.isfinite(torch.tensor([r["loss"], r["val_loss"]])).all())
        self.assertEqual(r["step"], 4)

    def test_resume_is_bit_exact(self):
        for balance in ("bias", "aux"):
            common = ("--steps", "6", "--balance", balance, "--grad-accum", "2")
            straight = self.train(f"straight_{balance}", *common)
            self.train(f"resumed_{balance}", *common, "--stop-after", "3")
            self.assertEqual(self.final_params(f"resumed_{balance}")[1]["step"], 3)
            resumed = self.train(f"resumed_{balance}", *common, "--resume")
            self.assertEqual(resumed["step"], 6)
            self.assertEqual(resumed["loss"], straight["loss"])
            sd_a, _ = self.final_params(f"straight_{balance}")
            sd_b, _ = self.final_params(f"resumed_{balance}")
            self.assertEqual(sd_a.keys(), sd_b.keys())
            for k in sd_a:
                self.assertTrue(torch.equal(sd_a[k], sd_b[k]), k)
            if balance == "bias":
                self.assertFalse(
                    torch.equal(sd_a["blocks.0.moe.router.expert_bias"], torch.zeros(4))
                )
            lines = [json.loads(s) for s in open(self.tmp / f"resumed_{balance}" / "metrics.jsonl")]
            ref = [json.loads(s) for s in open(self.tmp / f"straight_{balance}" / "metrics.jsonl")]
            self.assertEqual([r["loss"] for r in lines], [r["loss"] for r in ref])

    def test_resume_with_other_config_names_the_field(self):
        self.train("run", "--steps", "2")
        before = _files(self.tmp / "run")
        with self.assertRaisesRegex(
            ValueError, r"moe\.num_experts=4 .* moe\.num_experts=8 .*--experts"
        ):
            self.train("run", "--steps", "4", "--resume", "--experts", "8")
        with self.assertRaisesRegex(ValueError, r"dim=32 .* dim=64 .*--dim"):
            self.train("run", "--steps", "4", "--resume", "--dim", "64")
        with self.assertRaisesRegex(ValueError, r"moe\.expert_bias=True .*False .*--balance"):
            self.train("run", "--steps", "4", "--resume", "--balance", "none")
        self.assertEqual(_files(self.tmp / "run"), before)
        # flags that do not change the model or the data order may change
        r = self.train("run", "--steps", "3", "--resume", "--lr", "1e-3", "--grad-accum", "2")
        self.assertEqual(r["step"], 3)

    def test_resume_without_checkpoint(self):
        with self.assertRaisesRegex(
            FileNotFoundError, r"no checkpoint at .*missing[/\\]checkpoint"
        ):
            self.train("missing", "--steps", "2", "--resume")
        self.assertFalse((self.tmp / "missing").exists())

    def test_fresh_run_refuses_to_overwrite(self):
        self.train("run", "--steps", "1")
        with self.assertRaisesRegex(FileExistsError, "pass --resume"):
            self.train("run", "--steps", "1")

    def test_resume_from_corrupted_checkpoint(self):
        self.train("run", "--steps", "2")
        ckpt = self.tmp / "run" / "checkpoint"
        for name, garble in [
            (".metadata", lambda b: b[: len(b) // 2]),  # truncated
            (".metadata", lambda b: b"not a pickle" + b[12:]),  # garbled
            ("__0_0.distcp", lambda b: b[:100]),  # truncated tensor data
            ("config.json", lambda b: b[:-10]),  # broken JSON
        ]:
            original = (ckpt / name).read_bytes()
            (ckpt / name).write_bytes(garble(original))
            before = _files(self.tmp / "run")
            with self.assertRaisesRegex(RuntimeError, f"checkpoint {ckpt} is corrupted"):
                self.train("run", "--steps", "4", "--resume")
            self.assertEqual(_files(self.tmp / "run"), before, name)
            (ckpt / name).write_bytes(original)
        self.assertEqual(self.train("run", "--steps", "3", "--resume")["step"], 3)

    def test_failed_save_keeps_previous_checkpoint(self):
        real_save = train_moe_lm.dcp.save
        calls = []

        def flaky_save(state, *, checkpoint_id, **kwargs):
            calls.append(checkpoint_id)
            if len(calls) == 2:  # write part of the files, then fail
                real_save(state, checkpoint_id=checkpoint_id, **kwargs)
                (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"")
                raise OSError("No space left on device")
            return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

        with mock.patch.object(train_moe_lm.dcp, "save", flaky_save):
            with self.assertRaisesRegex(OSError, "No space left"):
                self.train("run", "--steps", "4", "--ckpt-every", "2")
        out = self.tmp / "run"
        self.assertEqual(
            sorted(p.name for p in out.iterdir() if "checkpoint" in p.name), ["checkpoint"]
        )
        _, run = self.final_params("run")
        self.assertEqual(run["step"], 2)
        self.assertEqual(self.train("run", "--steps", "4", "--resume")["step"], 4)

    def test_crash_between_renames_resumes_from_prev(self):
        self.train("run", "--steps", "2")
        out = self.tmp / "run"
        (out / "checkpoint").rename(out / "checkpoint.prev")
        self.assertEqual(self.train("run", "--steps", "3", "--resume")["step"], 3)
        self.assertEqual(
            sorted(p.name for p in out.iterdir() if "checkpoint" in p.name), ["checkpoint"]
        )

    def test_fp8_blockwise_tracks_bf16(self):
        def losses(precision):
            args = ["--steps", "12", "--ckpt-every", "0", "--precision", precision]
            result = self.train(precision, *args)
            with open(Path(result["out"]) / "metrics.jsonl") as f:
                return result, [json.loads(line)["loss"] for line in f]

        _, bf16 = losses("bf16")
        result, fp8 = losses("fp8_blockwise")
        self.assertEqual(len(fp8), 12)
        self.assertLess(fp8[-1], fp8[0] - 0.5)  # it learns
        for step, (a, b) in enumerate(zip(bf16, fp8), 1):
            self.assertLess(abs(b - a) / a, 0.02, f"step {step}: bf16 {a:.4f} fp8 {b:.4f}")
        model, run = train_moe_lm.load_model(result["out"])
        self.assertEqual(run["precision"], "fp8_blockwise")
        self.assertEqual(model.moe_layers()[0].experts.precision, "fp8_blockwise")

    def test_bad_precision_flag(self):
        with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
            train_moe_lm.parse_args(["--precision", "fp4"])
        self.assertRegex(err.getvalue(), r"--precision: invalid choice: 'fp4'.*'mxfp8'")

    def test_expert_parallel_needs_torchrun(self):
        # --ep N runs under torchrun (test/test_expert_parallel.py); without it: a usage error
        with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
            train_moe_lm.main(["--ep", "2"])
        self.assertIn("--ep 2 must equal the number of processes (WORLD_SIZE=1)", err.getvalue())

    def test_presets_build(self):
        for preset in ("mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"):
            args = train_moe_lm.parse_args(["--preset", preset, "--experts", "8", "--top-k", "2"])
            cfg = train_moe_lm.model_config(args).moe
            self.assertEqual((cfg["num_experts"], cfg["top_k"], cfg["dim"]), (8, 2, 128))
            if preset == "deepseek-v3":
                self.assertEqual((cfg["num_expert_groups"], cfg["num_limited_groups"]), (4, 2))
                self.assertEqual((cfg["score_func"], cfg["shared_hidden_dim"]), ("sigmoid", 128))
            if preset == "qwen2-moe":
                self.assertEqual(cfg["shared_hidden_dim"], 512)
        r = self.train("ds", "--steps", "2", "--preset", "deepseek-v3", "--precision", "bf16")
        self.assertTrue(torch.isfinite(torch.tensor(r["loss"])))


if __name__ == "__main__":
    run_tests()
