"""torchvision's op schemas on CPU torch, declared before sglang is imported: the rule lives in
kvbroker_tools.serving.cpu_torchvision, shared with the real servers' start-up."""

from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

__all__ = ["declare_torchvision_ops"]
