"""The Lightning module's training step: mixup and cutmix on batches of any size."""

from __future__ import annotations

import pytest
import torch

from train.module import ViTClassifier

NET = dict(patch_size=8, embed_dim=16, depth=1, num_heads=2)  # img_size is its own argument


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_mixup_takes_a_batch_of_any_size(batch):
    # timm's Mixup pairs images and refuses an odd batch: a training set smaller than one batch (or its last
    # batch) must still train
    torch.manual_seed(0)
    mix = dict(mixup_alpha=0.8, cutmix_alpha=1.0)
    module = ViTClassifier(num_classes=5, img_size=16, variant="vit_tiny_patch16_224", net_args=NET, **mix)
    x, y = torch.rand(batch, 3, 16, 16), torch.arange(batch) % 5
    mixed, soft = module._mix(x.clone(), y)
    assert mixed.shape == x.shape and soft.shape == (batch, 5)
    torch.testing.assert_close(soft.sum(1), torch.ones(batch))
    if batch % 2:  # the unpaired image keeps its pixels and its own (smoothed) label
        torch.testing.assert_close(mixed[-1], x[-1])
        assert soft[-1].argmax() == y[-1] and soft[-1].max() == pytest.approx(0.9 + 0.1 / 5)


def test_compile_gives_the_training_step_the_compiled_network_and_the_checkpoint_the_weights_once(monkeypatch):
    # `compiled or net` asked the compiled module for its length, which it refuses: --model.compile true failed at
    # the first step. Compiling takes a minute, so this stops short of a step: the wrapper is made lazily.
    import lightning.pytorch as pl
    from torch._dynamo.eval_frame import OptimizedModule

    monkeypatch.setenv("CXX", "true")  # a compiler on PATH, whatever the machine: nothing is compiled before a step
    module = ViTClassifier(num_classes=5, img_size=16, variant="vit_tiny_patch16_224", net_args=NET, compile=True)
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    module.setup("fit")
    assert isinstance(module.train_net, OptimizedModule) and module.train_net._orig_mod is module.net
    assert not any("compiled" in k or "_orig_mod" in k for k in module.state_dict())
    plain = ViTClassifier(num_classes=5, img_size=16, variant="vit_tiny_patch16_224", net_args=NET)
    assert plain.train_net is plain.net


def test_compile_without_a_cpp_compiler_trains_eager_and_says_why(monkeypatch, caplog):
    # on CPU torch.compile builds C++ kernels: a machine without g++ must still train, and say what is missing
    import lightning.pytorch as pl

    monkeypatch.setenv("CXX", "no-such-compiler")
    module = ViTClassifier(num_classes=5, img_size=16, variant="vit_tiny_patch16_224", net_args=NET, compile=True)
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    with caplog.at_level("WARNING", logger="train.module"):
        module.setup("fit")
    assert module.train_net is module.net
    assert "no C++ compiler ('no-such-compiler' is not on PATH" in caplog.text and "training runs eager" in caplog.text


def test_a_compile_that_fails_at_the_first_step_goes_on_eager(monkeypatch, caplog):
    # a compiler that is there but fails (`false`): torch.compile raises at the first forward pass; the step goes on
    import lightning.pytorch as pl
    from torch._inductor import config

    monkeypatch.setenv("CXX", "false")  # on PATH, so setup compiles, whether or not this machine has g++
    torch._dynamo.reset()
    module = ViTClassifier(num_classes=5, img_size=16, variant="vit_tiny_patch16_224", net_args=NET, compile=True)
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    module.setup("fit")
    x = torch.rand(2, 3, 16, 16)
    # torch's own patch, not monkeypatch's: its undo deleted the two settings (monkeypatch did not see them, so it
    # took them for new), and every later torch.compile in the same process failed on "does not exist"
    # (fx_graph_cache off: a kernel built by an earlier run would need no compiler)
    with (
        caplog.at_level("WARNING", logger="train.module"),
        config.patch({"cpp.cxx": (None, "false"), "fx_graph_cache": False}),
    ):
        logits = module._train_logits(x)
    assert "--model.compile failed, training goes on eager: InvalidCxxCompiler: No working C++ compiler" in caplog.text
    assert module.train_net is module.net and logits.shape == (2, 5)
    torch.testing.assert_close(logits, module.net(x))
