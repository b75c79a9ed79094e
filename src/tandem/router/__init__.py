"""The PD router: OpenAI API in front of prefill/decode workers (see docs/router.md)."""
