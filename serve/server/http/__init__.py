"""HTTP around the routes: connection limits (protocol), the Host and key checks (guard), the request record
(record), uploads, and the one error writer (errors)."""
