"""common: knowledge every layer reads (errors, units, redaction, environment variables, the Hugging
Face config reader, atomic writes). Standard library only; imports nothing else of traindx."""
