"""The engine: model runner, sampler, detokenizer and the Engine that composes them."""
