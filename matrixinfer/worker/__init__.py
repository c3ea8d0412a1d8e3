"""Workers: one per rank; device, model shard, paged latent KV cache, model runner, sampler."""
