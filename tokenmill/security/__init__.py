"""Secrets and message authentication shared by the multi-host pieces (KV transfer, router, KV events,
sessions). Standard library only: no torch, no engine imports (docs/security.md)."""
from tokenmill.security.cluster_secret import (SECRET_ENV, SecretError, default_secret_path, load_cluster_secret,
                                               read_secret_file)
from tokenmill.security.mac import AuthError, sign, sign_params, verify, verify_params

__all__ = ["SECRET_ENV", "AuthError", "SecretError", "default_secret_path", "load_cluster_secret",
           "read_secret_file", "sign", "sign_params", "verify", "verify_params"]
