"""The peer scheduler: which prefill and which decode instance serve a request.

- least-loaded (the paper): the KV cache lives in a pool every instance reaches equally, so
  placement ignores where cached data is: the prefill instance with the fewest queued prompt
  tokens, the decode instance with the fewest running requests and the most free KV;
- locality (Dynamo-style, to compare against): cost = w * prefill blocks to compute on that
  instance (blocks it has not seen recently) + its queued blocks;
- round-robin.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from matrixinfer.engine.block_hash import block_hashes, root_hash
from matrixinfer.pdc.instance import Instance


class Router:
    def choose_prefill(self, instances: list[Instance], prompt: list[int], namespace: str) -> Instance:
        raise NotImplementedError

    def choose_decode(self, instances: list[Instance]) -> Instance:
        return min(instances, key=lambda i: (i.num_requests, i.stats.kv_cache_usage, i.index))

    def observe(self, instance: Instance, prompt: list[int], namespace: str) -> None:
        """A prompt was sent to `instance` (locality remembers which blocks it has)."""


class LeastLoaded(Router):
    def choose_prefill(self, instances, prompt, namespace):
        return min(instances, key=lambda i: (i.queued_prompt_tokens, i.num_requests, i.index))


class RoundRobin(Router):
    def __init__(self):
        self._next = itertools.count()

    def choose_prefill(self, instances, prompt, namespace):
        return instances[next(self._next) % len(instances)]

    def choose_decode(self, instances):
        return instances[next(self._next) % len(instances)]


class Locality(Router):
    def __init__(self, block_size: int, weight: float = 1.0, capacity: int = 65536):
        self.block_size, self.weight, self.capacity = block_size, weight, capacity
        self.seen: dict[str, OrderedDict[bytes, None]] = {}  # instance name -> recently prefilled blocks

    def _blocks(self, prompt, namespace):
        return block_hashes(prompt, self.block_size, root_hash("router", namespace))

    def choose_prefill(self, instances, prompt, namespace):
        blocks = self._blocks(prompt, namespace)

        def cost(inst: Instance) -> tuple:
            seen = self.seen.get(inst.name, {})
            hit = next((i for i, b in enumerate(blocks) if b not in seen), len(blocks))
            to_compute = -(-len(prompt) // self.block_size) - hit
            return (self.weight * to_compute + inst.queued_prompt_tokens / self.block_size, inst.index)

        return min(instances, key=cost)

    def observe(self, instance, prompt, namespace):
        seen = self.seen.setdefault(instance.name, OrderedDict())
        for b in self._blocks(prompt, namespace):
            seen[b] = None
            seen.move_to_end(b)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


def make_router(name: str, block_size: int) -> Router:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    if name == "locality":
        return Locality(block_size)
    raise ValueError(f"unknown router {name!r} (least-loaded, locality, round-robin)")
