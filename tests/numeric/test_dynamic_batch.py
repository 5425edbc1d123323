"""Dynamic batch (config.enable_dynamic_batch()): one compiled program runs every batch size,
with the numbers of eager torch (docs/training.md, "Dynamic batch")."""

from __future__ import annotations

import copy

import pytest
import torch
import tvm
from torch import nn
from torch.nn import functional as F

import tvmgraph

from tests.conftest import Fn, ModuleGraph, TrainGraph, assert_close
from tests.models import EncoderBlock, SmallCNN, mlp
from tests.numeric.test_training import STEP_TOL, assert_same_state, eager_step
from tvmgraph.errors import GraphArgumentError, TraceError, UnsupportedOpError, UnsupportedOptionError

BATCHES = (1, 7, 64, 300)


def dynamic(graph):
    graph.config.enable_dynamic_batch()
    return graph


@pytest.mark.parametrize("make, shape", [
    (mlp, (32,)),
    pytest.param(lambda: SmallCNN().eval(), (3, 12, 12), marks=pytest.mark.slow),
    pytest.param(lambda: EncoderBlock().eval(), (10, 32), marks=pytest.mark.slow),
], ids=["mlp", "cnn", "transformer"])
def test_inference_every_batch_size_one_compile(make, shape) -> None:
    torch.manual_seed(0)
    model = make()
    graph = dynamic(ModuleGraph(model))
    for batch in BATCHES:
        x = torch.randn(batch, *shape)
        with torch.no_grad():
            expected = model(x)
        assert_close(graph(x), expected, atol=1e-5, rtol=1e-4)
    assert dynamic_entries(graph) == 1


def dynamic_entries(graph: tvmgraph.nn.Graph) -> int:
    """The graph's compiled programs with a dynamic batch: a batch of 1 gets a static one of its
    own (tvmgraph/dynamic_batch.py), which this does not count."""
    return sum(len(programs) for signature, programs in graph._state().entries.items()
               if any(leaf.shape[:1] == (None,) for leaf in signature.leaves))


def run_dynamic_side_by_side(model, batches, lr=0.05, loss_fn=None):
    """Train `model` in a dynamic-batch graph and a copy eagerly on `batches`; compare every step."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    reference = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)  # noqa: E731
    optimizer, ref_optimizer = make(model), make(reference)
    graph = dynamic(TrainGraph(model, loss_fn, optimizer))
    for step, (x, y) in enumerate(batches):
        loss = graph(x, y)
        ref_loss = eager_step(reference, loss_fn, [ref_optimizer], x, y)
        torch.testing.assert_close(loss, ref_loss, **STEP_TOL, msg=lambda m: f"step {step} (batch {len(x)}): {m}")
        assert_same_state(model, reference)
    return graph


def batches_of(sizes, shape, classes=10):
    return [(torch.randn(n, *shape), torch.randint(0, classes, (n,))) for n in sizes]


def test_training_mlp_varying_batch_matches_eager() -> None:
    torch.manual_seed(0)
    graph = run_dynamic_side_by_side(mlp(), batches_of((8, 3, 64, 1, 300, 8), (32,)))
    assert dynamic_entries(graph) == 1 and graph.step == 6


def test_group_norm_with_a_varying_batch_matches_eager() -> None:
    """GroupNorm's converter took the batch size from the traced call's arguments (a symbol
    with a dynamic batch: TypeError in int()); it reads it from the input's shape now.
    Inference, then training (its mean and rstd feed the gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10))
    graph = dynamic(ModuleGraph(copy.deepcopy(model).eval()))
    for batch in (2, 5, 1):
        x = torch.randn(batch, 3, 6, 6)
        with torch.no_grad():
            assert_close(graph(x), graph.model(x), atol=1e-5, rtol=1e-4)
    graph = run_dynamic_side_by_side(model, batches_of((4, 1, 7), (3, 6, 6)))
    assert dynamic_entries(graph) == 1


@pytest.mark.parametrize("running_stats", [False, True], ids=["batch_stats", "running_stats"])
def test_instance_norm_with_a_varying_batch_matches_eager(running_stats: bool) -> None:
    """InstanceNorm normalizes (1, n * C, H, W), a symbolic channel count with a dynamic batch:
    TVM's batch_norm and the stock reshape converter refused it (a CompileError called a
    tvmgraph bug). Training (its running statistics too), then inference in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True, track_running_stats=running_stats),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 10))
    graph = run_dynamic_side_by_side(model, batches_of((4, 1, 3), (3, 6, 6)))
    assert dynamic_entries(graph) == 1
    model.eval()
    graph = dynamic(ModuleGraph(model))
    for batch in (2, 5):
        x = torch.randn(batch, 3, 6, 6)
        with torch.no_grad():
            assert_close(graph(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_upsampling_and_adaptive_pooling_train_with_a_varying_batch(mode: str) -> None:
    """The gradients of resize2d (F.interpolate) and adaptive_avg_pool2d are products with
    constant matrices along H and W: they asked for a static batch too (UnsupportedOpError on
    a U-Net with bilinear upsampling); only H and W need to be static."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2, mode=mode),
                          nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(36, 10))
    graph = run_dynamic_side_by_side(model, batches_of((4, 1, 6), (3, 5, 5)))
    assert dynamic_entries(graph) == 1


def test_training_through_flatten_and_mse_mean_matches_eager() -> None:
    """x.flatten(1) reshapes to a shape holding the batch; mse_loss takes a mean over it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    graph = dynamic(TrainGraph(model, nn.MSELoss(), optimizer))
    for batch in (1, 5, 33):
        x, y = torch.randn(batch, 3, 2, 2), torch.randn(batch, 4)
        torch.testing.assert_close(graph(x, y), eager_step(reference, nn.MSELoss(), [ref_optimizer], x, y), **STEP_TOL)
        assert_same_state(model, reference)
    assert dynamic_entries(graph) == 1


@pytest.mark.slow
def test_training_cnn_batch_norm_varying_batch_matches_eager() -> None:
    """Batch-norm statistics (batch mean/variance, unbiased running variance) over a symbolic
    batch, convolutions, pools and a flatten."""
    torch.manual_seed(0)
    model = SmallCNN().train()
    graph = run_dynamic_side_by_side(model, batches_of((8, 5, 16), (3, 12, 12)))
    assert dynamic_entries(graph) == 1
    assert model.features[1].num_batches_tracked.item() == 3


def test_training_wide_convs_varying_batch_matches_eager() -> None:
    """Channels that fill the implicit-GEMM tiles (schedules/conv_gemm.py), a strided conv whose
    weight gradient crops its data, batch-norm statistics: over a symbolic batch, dW and the
    statistics sum over it (the scheduled kernels' reduction, not just their output, is open)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(4, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 1, stride=2), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).train()
    graph = run_dynamic_side_by_side(model, batches_of((8, 5, 16), (4, 8, 8)))
    assert dynamic_entries(graph) == 1


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    EncoderBlock,
    lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu",
                                                             batch_first=True),
                                  num_layers=2, enable_nested_tensor=False),
], ids=["encoder-block", "torch-encoder"])
def test_training_a_transformer_varying_batch_matches_eager(make) -> None:
    """Attention reshapes and expands the symbolic batch (batch * heads, batch * seq): TVM's
    autodiff failed on the copy of attention's `expand` (training/symbolic_shapes.py); now the
    steps match eager at every batch size, with one compile."""
    torch.manual_seed(0)
    regression = [(torch.randn(n, 10, 32), torch.randn(n, 10, 32)) for n in (4, 1, 9)]
    graph = run_dynamic_side_by_side(make(), regression, lr=0.02, loss_fn=nn.MSELoss())
    assert dynamic_entries(graph) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_tied", "resnet18", "vit", "lstm", "gru", "seq2seq", "unet", "llama",
                                  "mobilenetv3", "convnext", "encoder", "tcn", "atrous"])
def test_training_models_no_one_here_wrote_varying_batch(name: str) -> None:
    """The model zoo's GPT with tied embeddings (the embedding's gradient takes n * seq token
    indices), ResNet-18, the ViT (its class token expanded over the batch, then concatenated:
    autodiff's copy of a broadcast to a symbolic shape had no shape, training/symbolic_shapes.py)
    an LSTM and a GRU (their initial states are zeros of a lifted shape, which the
    gradients now read through the shape parameter's dims), nn.Transformer with a padding
    embedding (its scale, ones of the batch's token count, had no dims in autodiff's copy) and a
    UNet (nearest upsampling asked for a static batch where it needs static H and W only) and
    the LLaMA-style decoder (its attention projection, a Linear on a strided 3-D view, is a
    batched matmul with the weight broadcast over the batch: autodiff's copy of that broadcast
    had no dims, nor had the RMSNorm after it), a MobileNetV3 (squeeze-excite scales), a ConvNeXt,
    nn.TransformerEncoder, a dilated conv1d net and an atrous CNN (flipped-kernel input gradients),
    at batch sizes 3, 5 and 1 with one compile: every step as close to float64 eager as the zoo
    test asks of a static graph (ResNet-18's batch norms at 1x1 and 2x2 pixels make float32
    itself drift by 6e-5 there)."""
    assert_zoo_trains_with_varying_batch(name, torch.device("cpu"))


def assert_zoo_trains_with_varying_batch(name: str, device: torch.device) -> None:
    """ZOO[name] trained in one dynamic-batch graph on `device` at batch sizes 3, 5 and 1,
    every step against eager float64 and float32 on the same device (tests/numeric/test_model_zoo.py).

    Batch 1 comes last: its step through ResNet-18's batch norms (2x2 pixels, 4 values per
    channel) amplifies float32 rounding about 100x (eager float32's momentum buffers 1e-4 from
    float64's), and a step after it may meet an activation within that distance of ReLU's kink
    that float32 and float64 then send different ways: on Zen 4 one channel of the stem's
    weight (27 values) moved 1.8e-3 from float64 at batch 5, 5e-6 from the kink."""
    from tests.numeric.test_model_zoo import _assert_step_close, _double
    from tests.numeric.zoo import ZOO

    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make().train().to(device)
    reference, eager32 = copy.deepcopy(model).double(), copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)  # noqa: E731
    optimizers = [make(m) for m in (model, reference, eager32)]
    graph = dynamic(TrainGraph(model, entry.loss, optimizers[0]))
    g = torch.Generator().manual_seed(2)
    for step, n in enumerate((3, 5, 1)):
        x, y = entry.batch(g)
        rows = torch.arange(n) % len(x)
        x, y = x[rows] + (0.1 * torch.randn(x[rows].shape) if x.is_floating_point() else 0), y[rows]
        x, y = x.to(device), y.to(device)
        loss = graph(x, y)
        _assert_step_close(loss, eager_step(reference, entry.loss, [optimizers[1]], _double(x), y),
                           eager_step(eager32, entry.loss, [optimizers[2]], x, y), f"step {step} (batch {n}) loss")
        for (key, got), want, got32 in zip(model.state_dict().items(), reference.state_dict().values(),
                                          eager32.state_dict().values()):
            _assert_step_close(got, want, got32, f"step {step} (batch {n}) {key}")
    assert dynamic_entries(graph) == 1


def test_autodiff_failing_on_a_dynamic_batch_is_a_clear_error() -> None:
    """`torch.tril(torch.ones(n, n))` in a training graph, n the batch: a fill of a lifted
    [n, n] shape has no dims in TVM's autodiff copy, and the gradients reading it cannot go on:
    an UnsupportedOpError that says to train with a static batch. (The zoo's LLaMA,
    `torch.arange(x.shape[0])`, nn.Transformer, a U-Net, an LSTM and a GRU were this test's
    examples until their gradients learned symbolic shapes.)"""

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tril(torch.ones(x.shape[0], x.shape[0])) @ self.lin(x)

    model = Causal()
    graph = dynamic(TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(UnsupportedOpError, match=r"dynamic batch .* Train it with a static batch"):
        graph(torch.randn(3, 4), torch.randn(3, 4))


def test_picking_each_rows_label_with_arange_trains_like_eager() -> None:
    """`logp[torch.arange(n), y]` (a hand-written NLL loss) and `torch.arange(0, 2 * n, 2)`:
    a range of the batch's length, which TVM's autodiff could not copy into its backward pass,
    is a running count of ones of the batch's shape (training/symbolic_shapes.py); the pick's
    gradient takes the symbolic count of rows."""

    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 5)

        def forward(self, x):
            return self.lin(x).log_softmax(-1) * (1 + torch.arange(0, 2 * x.shape[0], 2).float().view(-1, 1) / 10)

    def picked_nll(logp, y):
        return -logp[torch.arange(logp.shape[0]), y].mean()

    torch.manual_seed(0)
    batches = [(torch.randn(n, 6), torch.randint(0, 5, (n,))) for n in (4, 1, 7)]
    graph = run_dynamic_side_by_side(Weighted(), batches, loss_fn=picked_nll)
    assert dynamic_entries(graph) == 1


def test_a_contrastive_loss_over_the_batch_trains_like_eager() -> None:
    """A CLIP-style loss: [n, n] similarities of two embeddings of the batch, labels
    `torch.arange(n)` both ways, the diagonal masked with `torch.eye(n)`: both dims of the
    logits are the batch."""

    class TwoTowers(nn.Module):
        def __init__(self):
            super().__init__()
            self.image, self.text = nn.Linear(6, 8), nn.Linear(5, 8)

        def forward(self, x):
            a = nn.functional.normalize(self.image(x[:, :6]), dim=-1)
            b = nn.functional.normalize(self.text(x[:, 6:]), dim=-1)
            return a @ b.T * 5.0

    def contrastive(logits, weight):
        labels = torch.arange(logits.shape[0])
        off_diagonal = logits.masked_fill(torch.eye(logits.shape[0], dtype=torch.bool), 0).abs().mean()
        per_row = nn.functional.cross_entropy(logits, labels, reduction="none") \
            + nn.functional.cross_entropy(logits.T, labels, reduction="none")
        return (per_row * weight).mean() + 0.1 * off_diagonal

    torch.manual_seed(0)
    batches = [(torch.randn(n, 11), torch.rand(n)) for n in (4, 2, 7)]
    graph = run_dynamic_side_by_side(TwoTowers(), batches, loss_fn=contrastive)
    assert dynamic_entries(graph) == 1


def test_repeat_by_a_count_of_the_batch_trains_like_eager() -> None:
    """`w.repeat(x.shape[0] * 8)`: TVM's tile takes constant counts only (a CompileError); the
    repeat is a broadcast of w viewed with a unit axis before each dim (tvmgraph/converters.py).
    A constant count keeps tile."""

    class Repeated(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.scale = nn.Parameter(torch.randn(6))

        def forward(self, x):
            h = self.lin(x)
            per_token = (h.reshape(-1) * self.scale.repeat(x.shape[0] * 3)).view(x.shape[0], 3, 6)
            return per_token + self.scale.view(1, 6).repeat(2, 1).sum(0)

    torch.manual_seed(0)
    batches = [(torch.randn(n, 3, 6), torch.randn(n, 3, 6)) for n in (4, 1, 7)]
    graph = run_dynamic_side_by_side(Repeated(), batches, loss_fn=nn.MSELoss())
    assert dynamic_entries(graph) == 1


def test_fills_of_the_batch_shape_train_like_eager() -> None:
    """`torch.ones(x.shape[0])` (and a padding embedding's scale): a fill of a shape lifted to a
    parameter had no dims in autodiff's copy of the forward pass, and the gradients that read
    them failed (the zoo's nn.Transformer, with a padding embedding). A fill like a tensor of
    that shape keeps them (training/symbolic_shapes.py)."""

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8, padding_idx=0)
            self.lin = nn.Linear(8, 4)

        def forward(self, tokens):
            h = self.embed(tokens).mean(1)
            gate = torch.where(h[:, 0] > 0, 0.5, torch.ones(tokens.shape[0]))
            return (self.lin(h) * gate.unsqueeze(-1) + torch.zeros(tokens.shape[0], 4)).reshape(-1, 2, 2).sum(-1)

    torch.manual_seed(0)
    batches = [(torch.randint(0, 10, (n, 5)), torch.randn(n, 2)) for n in (4, 1, 7)]
    graph = run_dynamic_side_by_side(Gated(), batches, loss_fn=nn.MSELoss())
    assert dynamic_entries(graph) == 1


def test_arithmetic_on_the_batch_size_trains_like_eager() -> None:
    """`loss / x.shape[0]`, `x * (n / 8.0)`, `/ (n * 5)`, `+ n`: the batch size is a symbolic int,
    which reached a tensor op as an int64 scalar beside a float tensor (a CompileError), and
    Python's float arithmetic on it (`torch.sym_float`, `/`) had no converter
    (tvmgraph/symbolic_scalars.py)."""

    class PerSample(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4)

        def forward(self, x):
            n = x.shape[0]
            h = self.lin(x) * (n / 8.0) + n
            return h / (n * 5) + h.sum() / x.shape[0] + x.new_ones(n).sum() / n

    torch.manual_seed(0)
    batches = [(torch.randn(n, 6), torch.randn(n, 4)) for n in (8, 3, 5)]
    graph = run_dynamic_side_by_side(PerSample(), batches, loss_fn=nn.MSELoss())
    assert dynamic_entries(graph) == 1


def test_causal_padding_and_amax_train_like_eager() -> None:
    """A WaveNet's causal `F.pad` of the time axis and a max over time (`amax`): their gradients
    read static shapes only, so the dynamic batch failed ("relax.nn.pad: tvmgraph.gradients
    need static shapes"); now the unpadded batch axis may be symbolic."""

    class CausalConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 6, 3, dilation=2)
            self.out = nn.Linear(12, 2)

        def forward(self, x):
            h = torch.tanh(self.conv(F.pad(x, (4, 0))))
            return self.out(torch.cat([h.amax(-1), h.amin(-1)], -1))

    torch.manual_seed(0)
    batches = [(torch.randn(n, 3, 10), torch.randn(n, 2)) for n in (4, 1, 7)]
    graph = run_dynamic_side_by_side(CausalConv(), batches, loss_fn=nn.MSELoss())
    assert dynamic_entries(graph) == 1


def test_batch_64_matmul_gets_the_matmul_schedule() -> None:
    """The register-tiled Matmul rule (tvmgraph/schedules/matmul.py) takes the dense layers of a
    dynamic graph, not the Fallback or Reduction rule: its accumulator tile is a cache_write block
    (`..._global`) around an unrolled, vectorized FMA loop, in parallel over the (padded) batch."""
    graph = dynamic(ModuleGraph(mlp((32, 64, 64, 10))))
    graph(torch.randn(64, 32))
    compiled = graph.compiled  # maybe from the compiled cache: build it again to see its TIR
    optimized, _ = compiled.lowered.build(compiled.target, compiled.traced.signature.options)
    kernels = {gv.name_hint: f for gv, f in optimized.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint}
    assert len(kernels) == 3
    for name, func in kernels.items():
        text = func.script()
        assert "_reindex_pad_global" in text and "T.unroll" in text and "T.parallel" in text, name
        assert "TypeVar(" in text, name  # the kernel takes any batch size


def test_signature_leaves_the_batch_open() -> None:
    graph = dynamic(ModuleGraph(mlp()))
    graph(torch.randn(5, 32))
    spec = graph.compiled.traced.signature.leaves[0]
    assert spec.shape == (None, 32) and spec.describe() == "float32[batch, 32]"
    graph(torch.randn(9, 32))
    assert dynamic_entries(graph) == 1
    graph.config.enable_dynamic_batch(False)  # an option change compiles again, static
    graph(torch.randn(9, 32))
    assert graph.num_compiled == 2 and graph.compiled.traced.signature.leaves[0].shape == (9, 32)


def test_a_batch_of_one_is_its_own_static_entry_where_build_sees_the_one() -> None:
    """torch.export assumes a symbolic size is at least 2: `x.shape[0] == 1` was compiled as
    False (x100 at batch 1 ran as x2) and BatchNorm's "more than 1 value per channel" check
    away (a batch of 1 trained). A batch of 1 is compiled on its own, statically, as eager runs."""
    class Branch(nn.Module):
        def forward(self, x):
            return x * 100 if x.shape[0] == 1 else x * 2

    graph = dynamic(ModuleGraph(Branch()))
    for batch in (3, 1, 4, 1):
        x = torch.randn(batch, 5)
        assert_close(graph(x), Branch()(x))
    assert graph.num_compiled == 2 and dynamic_entries(graph) == 1
    assert graph.compiled.traced.signature.leaves[0].shape == (1, 5)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    train = dynamic(TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1)))
    train(torch.randn(4, 4), torch.randn(4, 8))
    with pytest.raises(tvmgraph.errors.TraceError, match="Expected more than 1 value per channel when training"):
        train(torch.randn(1, 4), torch.randn(1, 8))


def test_variance_along_the_batch_with_a_correction_matches_eager() -> None:
    """var/std along a dynamic batch with the default correction (n - 1) were refused ("requires
    statically known reduction-axis sizes"); n is counted at run time now. Inference, then
    training through the unbiased variance."""
    graph = dynamic(ModuleGraph(Fn(lambda x: (x.var(0), x.std(0), x.var((0, 1)), x.var(0, correction=2)))))
    for batch in (5, 3, 9):
        x = torch.randn(batch, 4)
        for got, want in zip(graph(x), (x.var(0), x.std(0), x.var((0, 1)), x.var(0, correction=2))):
            assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    run_dynamic_side_by_side(model, [(torch.randn(n, 4), torch.zeros(n)) for n in (6, 3, 8)],
                             loss_fn=lambda out, _: out.var(0).sum())
    assert graph.num_compiled == 1


def test_long_sums_along_a_dynamic_batch_keep_their_digits() -> None:
    """A column sum over a symbolic count of rows was one chain of additions per column (the
    schedules chunked only static ones): `x.var(0)` of 1e6 rows of 1e3 + randn came out 80
    (eager 1.0), a sum over (batch, 512) rows 60x eager's error; sums to one value the same
    (`x.var()` 80 too, an MSE loss 1e-4 off); a row along the batch (a
    batch norm's statistics) summed in chains that grew with the batch. Against float64."""
    graph = dynamic(ModuleGraph(Fn(lambda x: (x.var(0), x.sum(0), x.var(), x.mean((0, 1), keepdim=True)))))
    torch.manual_seed(0)
    for batch in (1_000_000, 5):
        x = 1e3 + torch.randn(batch, 4)
        variance, total, variance_all, mean = graph(x)
        assert_close(variance.double(), x.double().var(0), atol=0, rtol=2e-5)
        assert_close(total.double(), x.double().sum(0), atol=0, rtol=1e-6)
        assert_close(variance_all.double(), x.double().var(), atol=0, rtol=2e-5)
        assert_close(mean.double(), x.double().mean((0, 1), keepdim=True), atol=0, rtol=1e-6)
    graph = dynamic(ModuleGraph(Fn(lambda x: F.mse_loss(x, torch.zeros_like(x)))))
    for batch in (100_000, 64):
        x = 1e3 + torch.randn(batch, 1000)
        assert_close(graph(x).double(), F.mse_loss(x.double(), torch.zeros_like(x.double())), atol=0, rtol=1e-6)
    graph = dynamic(ModuleGraph(Fn(lambda x: x.sum((0, 1)))))
    x = 1e3 + torch.randn(64, 512, 64)
    assert_close(graph(x).double(), x.double().sum((0, 1)), atol=0, rtol=1e-6)
    # A batch norm's statistics: rows of batch x 65536 had been 64 chains of batch x 1024
    # additions (2.8e-6 off; eager 3e-8), a chunk per image now (3e-7).
    graph = dynamic(ModuleGraph(Fn(lambda x: x.var((0, 2, 3)))))
    x = 1e3 + torch.randn(32, 3, 256, 256)
    assert_close(graph(x).double(), x.double().var((0, 2, 3)), atol=0, rtol=1e-6)


def test_batch_norm_without_running_statistics_under_a_dynamic_batch_matches_eager() -> None:
    """F.batch_norm with no running statistics reaches Relax as an instance norm over the
    batch's axes; its legalization counted the elements with int() and raised on the symbolic
    batch (a PassError)."""
    graph = dynamic(ModuleGraph(Fn(lambda x: F.batch_norm(x, None, None, training=True))))
    torch.manual_seed(0)
    for batch in (5, 8):
        x = torch.randn(batch, 3, 4, 4)
        assert_close(graph(x), F.batch_norm(x, None, None, training=True), atol=1e-5, rtol=1e-4)


def test_batch_size_zero_is_a_clear_error() -> None:
    graph = dynamic(ModuleGraph(mlp()))
    with pytest.raises(GraphArgumentError, match=r"'args\[0\]' has batch size 0"):
        graph(torch.randn(0, 32))


def test_arguments_must_agree_on_the_batch_size() -> None:
    model = mlp()
    graph = dynamic(TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(GraphArgumentError, match=r"'x' and 'y' have batch sizes \(dim 0\) 4 and 3"):
        graph(torch.randn(4, 32), torch.randint(0, 10, (3,)))


class FixedBatch(nn.Module):
    def forward(self, x):
        return x.view(4, -1)


def test_build_that_fixes_the_batch_is_a_trace_error() -> None:
    graph = dynamic(ModuleGraph(FixedBatch()))
    with pytest.raises(TraceError, match=r"dynamic batch.*x\.flatten\(1\)"):
        graph(torch.randn(4, 2, 3))


def test_saving_a_dynamic_batch_graph_is_a_clear_error(tmp_path) -> None:
    graph = dynamic(ModuleGraph(mlp()))
    graph(torch.randn(3, 32))
    with pytest.raises(UnsupportedOptionError, match=r"dynamic batch .*enable_dynamic_batch\(False\)"):
        tvmgraph.save(graph, tmp_path / "mlp")
    model = mlp()  # a training graph's save traced zeros of the last call's shapes: a TypeError on the batch
    train = dynamic(TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1)))
    train(torch.randn(3, 32), torch.randn(3, 10))
    for program in ("inference", "train_step"):
        with pytest.raises(UnsupportedOptionError, match=r"dynamic batch .*enable_dynamic_batch\(False\)"):
            tvmgraph.save(train, tmp_path / program, program=program)


def test_raw_audio_conv1d_net_trains_like_eager_with_a_dynamic_batch() -> None:
    """examples/zoo.py's M5-style net: its conv1d gradients as im2col + matmul at height 1
    (Im2colConv) and its max pooling's gradient as a window argmax and a select
    (tvmgraph/max_pool_backward.py), with a symbolic batch: one compile, eager's steps."""
    from examples.zoo import AudioConv

    batches = [(torch.randn(n, 1, 700), torch.randint(0, 10, (n,))) for n in (4, 3, 6)]
    graph = run_dynamic_side_by_side(AudioConv(), batches, loss_fn=nn.CrossEntropyLoss())
    assert dynamic_entries(graph) == 1


def test_squeeze_of_named_dims_matches_eager_and_of_the_batch_is_refused() -> None:
    """`y.squeeze(-1)` of a regression head runs at every batch size; `y.squeeze()` lists the
    batch, which eager drops at batch 1 only (a rank no one program has): a clear
    UnsupportedOpError. TVM's squeeze dropped the symbolic batch always (a CompileError that
    blamed tvmgraph)."""
    head = nn.Linear(4, 1)
    graph = dynamic(ModuleGraph(Fn(lambda x: head(x).squeeze(-1))))
    for batch in BATCHES:
        x = torch.randn(batch, 4)
        assert_close(graph(x), head(x).squeeze(-1).detach())
    everything = dynamic(ModuleGraph(Fn(lambda x: head(x).squeeze())))
    with pytest.raises(UnsupportedOpError, match=r"squeeze\(\) of the batch dim with a dynamic batch.*y\.squeeze\(-1\)"):
        everything(torch.randn(3, 4))


def test_a_tensor_of_the_batch_size_matches_eager() -> None:
    """`torch.tensor(x.size(0))` (a symbolic size made a tensor) failed to compile."""
    layer = nn.Linear(4, 4)
    graph = dynamic(ModuleGraph(Fn(lambda x: layer(x) / torch.tensor(x.size(0), dtype=torch.float32))))
    for batch in BATCHES:
        x = torch.randn(batch, 4)
        assert_close(graph(x), (layer(x) / batch).detach())
    assert dynamic_entries(graph) == 1
