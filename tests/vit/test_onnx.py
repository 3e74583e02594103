"""The model exports to ONNX (opset >= 17, dynamic batch) and onnxruntime gives the same logits."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch


@pytest.mark.slow
@pytest.mark.parametrize("return_attn", [False, True], ids=["logits", "with-attention"])
@pytest.mark.parametrize("stem", ["patch", "conv"])
def test_exports_and_matches_onnxruntime(tmp_path, tiny_model, tiny_config, return_attn, stem):
    if stem == "conv":
        from vit import VisionTransformer

        torch.manual_seed(0)
        tiny_model = VisionTransformer(**tiny_config, stem="conv").eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            if return_attn:
                logits, attns = self.net(x, return_attn=True)
                return logits, torch.stack(attns, dim=1)  # (B, depth, nh, N, N)
            return self.net(x)

    path = tmp_path / "tiny.onnx"
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.onnx.export(
        Wrapper(tiny_model).eval(),
        (torch.randn(2, 3, 32, 32),),
        str(path),
        input_names=["pixels"],
        opset_version=18,
        dynamic_shapes={"x": {0: batch}},
        external_data=False,
    )
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert model.opset_import[0].version >= 17
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for B in (1, 5):  # the batch axis is dynamic
        x = torch.randn(B, 3, 32, 32)
        outputs = session.run(None, {"pixels": x.numpy()})
        with torch.no_grad():
            if return_attn:
                logits, attns = tiny_model(x, return_attn=True)
                np.testing.assert_allclose(outputs[1], torch.stack(attns, 1).numpy(), atol=1e-5)
            else:
                logits = tiny_model(x)
        np.testing.assert_allclose(outputs[0], logits.numpy(), atol=1e-4)
