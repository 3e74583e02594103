"""HTTP around the routes: connection limits (protocol), the request guard, uploads, and the one error writer."""
