"""`tandem serve`: a router and its workers on one host (see docs/router.md)."""
