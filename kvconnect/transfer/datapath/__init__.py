"""Moving bytes inside a host: socket I/O into registered memory (iov), chunked memcpy (copying),
host staging for device memory (staging) and CUDA copies (cuda). Shared by the transports."""
