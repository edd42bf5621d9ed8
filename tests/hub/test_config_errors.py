"""A hub with a broken GPU configuration refuses to start and says which option is wrong."""

from __future__ import annotations

import pytest
from traitlets.config import Config


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        (
            Config(GPUCapacity={"declared_inventory": "8 x A100-SXM9-1TB"}),
            "unknown GPU model 'A100-SXM9-1TB'",
        ),
        (
            Config(
                GPUCapacity={
                    "declared_inventory": "2 x T4",
                    "profiles": [{"slug": "big", "gpus": 1, "gpu_model": "H200"}],
                }
            ),
            "gpu_model ['H200'] is not in the GPU inventory (available: ['T4'])",
        ),
        (
            Config(GPUCapacity={"profiles": [{"slug": "neg", "gpus": "-1/4"}]}),
            "profile 'neg': gpus: '-1/4' is negative",
        ),
        (
            Config(GPUCapacity={"profiles": [{"slug": "odd", "gpus": 0.3}]}),
            "profile 'odd': gpus: 0.3 is not a multiple of 1/8 GPU",
        ),
        (
            Config(GPUCapacity={"headroom_fraction": 1.5}),
            "GPUCapacity.headroom_fraction must be in [0, 1), not 1.5",
        ),
        (
            # used to stop the hub with a bare OverflowError naming no option (source text: a
            # Config overlay holds plain data only, and inf is no literal)
            'c.GPUCapacity.default_user_quota_gpus = float("inf")\n',
            "GPUCapacity.default_user_quota_gpus: inf is not a number of GPUs",
        ),
        (
            Config(GPUCapacity={"user_quota_gpus": {"alice": -0.5}}),
            "GPUCapacity.user_quota_gpus['alice']: -0.5 is negative",
        ),
        (
            Config(GPUWarmPool={"pools": [{"profile": "gpu-9", "min": 1}]}),
            "GPUWarmPool.pools[0].profile: 'gpu-9' is not a profile of the catalog",
        ),
        (
            Config(GPUWarmPool={"timezone": "Mars/Olympus"}),
            "GPUWarmPool.timezone: 'Mars/Olympus' is not an IANA time zone",
        ),
    ],
    ids=[
        "unknown-declared-model",
        "profile-model-not-in-inventory",
        "negative-fraction",
        "not-eighths",
        "headroom",
        "infinite-default-quota",
        "negative-user-quota",
        "warm-pool-unknown-profile",
        "warm-pool-timezone",
    ],
)
def test_bad_gpu_config_stops_the_hub_with_a_message_naming_the_option(make_hub, overlay, message):
    hub = make_hub(overlay, start=False)
    hub.start(expect_failure=True)
    assert hub.wait_exit() != 0
    log = hub.log()
    assert "gpulab configuration error" in log
    assert message in log
