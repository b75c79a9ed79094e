"""The PD handoff, shared by the router's flows and the one-server `pd` role: `handoff.py` runs
the two legs of one request (`HandoffLegs`, implemented over HTTP in the router and over engine
clients in the server); `text.py` holds the stop-string hold-back both sides compute alike.
Nothing here imports torch or the engine: the router imports this package."""
