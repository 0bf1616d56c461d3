"""The model side: a Llama/Qwen2/Qwen3 decoder, its checkpoint loader, attention and sampling."""
