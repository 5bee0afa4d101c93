"""The edges: the gRPC servicers and what they share (conversion, status codes, admission, peer trust, TLS).

They translate and admit; they hold no rule. Only kvbroker.server assembles them."""
