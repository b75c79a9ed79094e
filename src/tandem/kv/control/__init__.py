"""The KV control plane every data plane uses: the rendezvous of a request's two legs, leases,
holds, confirmations and releases over one authenticated TCP connection kind (`wire`, `auth`,
`server` for the prefill side, `client` and `hold` for the decode side; docs/protocol.md, "The
KV port"); `plane` is the engine-wide object both connector sides hold."""
