"""Token sampling: per-step batch metadata, logit processing (bias, min_tokens, penalties,
top-k/top-p/min-p) and the Sampler the model runner calls once per step."""
from tokenmill.sampling.metadata import SamplingMetadata, SamplingRow
from tokenmill.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow"]
