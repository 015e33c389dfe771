import torch
from torch import nn

from wsi_pipeline.models import build_encoder
from wsi_pipeline.models.bn_calibration import calibrate_batchnorm


def test_running_stats_become_the_mean_of_the_batch_statistics(float64):
    """float64: the statistics are sums of 4 x 16 x 16 = 1024 terms of order 1, so both ways of
    computing them err by < 1024 * 2**-53 ~ 1e-13 relative; 1e-10 bounds that on any CPU."""
    torch.manual_seed(0)
    enc = build_encoder("resnet18").eval()
    assert enc.bn1.running_mean.dtype == torch.float64
    params = {k: v.clone() for k, v in enc.named_parameters()}
    batches = [torch.randn(4, 3, 32, 32) * 2 + 1 for _ in range(3)]
    assert calibrate_batchnorm(enc, batches) == 3
    # reference for the first BatchNorm: per-batch statistics of conv1's output, averaged
    with torch.no_grad():
        outs = [enc.conv1(x) for x in batches]
    mean = torch.stack([o.mean((0, 2, 3)) for o in outs]).mean(0)
    var = torch.stack([o.var((0, 2, 3), unbiased=True) for o in outs]).mean(0)
    torch.testing.assert_close(enc.bn1.running_mean, mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(enc.bn1.running_var, var, rtol=1e-10, atol=1e-12)
    assert not enc.training and enc.bn1.momentum == 0.1  # mode and momentum restored
    for k, v in enc.named_parameters():
        assert torch.equal(v, params[k]), k  # parameters untouched


def test_calibration_makes_frozen_bn_normalise_the_data():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).eval()
    x = torch.randn(16, 3, 12, 12) * 5 + 3
    before = enc(x)
    assert before.mean().abs() > 0.5 or (before.std() - 1).abs() > 0.5  # uncalibrated: not normalised
    calibrate_batchnorm(enc, [x[:8], x[8:]])
    after = enc(x)
    assert after.mean().abs() < 0.1 and (after.std() - 1).abs() < 0.1



def test_a_big_layers_encoder_calibrates_to_the_plain_encoders_statistics(float64):
    """The demo's Big-Layers method calibrates frozen BatchNorm: the bigified encoder gets the same
    statistics, and then computes the same embeddings, as the plain one (float64: sums of
    <= 8 x 16 x 16 terms, rounding < 1e-13 relative; 1e-10 bounds it)."""
    import copy

    from wsi_pipeline.bigl import bigify

    torch.manual_seed(0)
    plain = build_encoder("resnet18")
    big = bigify(copy.deepcopy(plain), 1, 2**22, device=torch.device("cpu"))
    batches = [torch.randn(8, 3, 32, 32) for _ in range(3)]
    assert calibrate_batchnorm(plain, batches) == calibrate_batchnorm(big, batches) == 3
    sp, sb = plain.state_dict(), big.state_dict()
    assert list(sp) == list(sb)
    for k, v in sp.items():
        torch.testing.assert_close(sb[k], v, rtol=1e-10, atol=1e-12, msg=k)
    assert float((sp["bn1.running_mean"]).abs().max()) > 1e-3  # calibration moved them off 0
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(big.eval()(x), plain.eval()(x), rtol=1e-10, atol=1e-12)
