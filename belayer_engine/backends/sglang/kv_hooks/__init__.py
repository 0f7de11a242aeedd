"""SGLang-side hook of the arena-held KV pool (see README.md); its modules run in SGLang's interpreter, top-level."""
