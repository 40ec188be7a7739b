"""Secret-looking server flags and server-info keys are stored redacted; every other flag as given."""
from __future__ import annotations

import pytest

from mpfa.mpfa_cli.harness.redaction import REDACTED, is_secret_name, redact_args, redact_info


@pytest.mark.parametrize(("args", "stored"), [
    (["--api-key=s3cret"], ["--api-key=<redacted>"]),
    (["--api-key", "s3cret", "--port", "1"], ["--api-key", "<redacted>", "--port", "1"]),
    (["--admin-api-key", "a", "--hf-token=b", "--ssl-keyfile-password", "c"],
     ["--admin-api-key", "<redacted>", "--hf-token=<redacted>", "--ssl-keyfile-password", "<redacted>"]),
    (["--api-key", "--port", "1"], ["--api-key", "--port", "1"]),  # no value to hide
    (["--API_KEY=x", "--client-secret", "y"], ["--API_KEY=<redacted>", "--client-secret", "<redacted>"]),
    (["--max-total-tokens", "4096", "--max-prefill-tokens=8", "--skip-tokenizer-init", "--ssl-keyfile", "k.pem"],
     ["--max-total-tokens", "4096", "--max-prefill-tokens=8", "--skip-tokenizer-init", "--ssl-keyfile", "k.pem"]),
    (["positional-token"], ["positional-token"]),  # not a flag
])
def test_secret_flags_are_redacted_in_either_form_and_others_kept(args, stored):
    assert redact_args(args) == stored


def test_server_info_secrets_are_redacted_at_any_depth():
    info = {"api_key": "s3cret", "admin_api_key": None, "enable_api_key": True, "hf_token": "",
            "max_total_tokens": 4096, "states": [{"password": 123}], "argv": ["--api-key", "s3cret"]}
    assert redact_info(info) == {"api_key": REDACTED, "admin_api_key": None, "enable_api_key": True, "hf_token": "",
                                 "max_total_tokens": 4096, "states": [{"password": REDACTED}],
                                 "argv": ["--api-key", REDACTED]}


@pytest.mark.parametrize(("name", "secret"), [
    ("api_key", True), ("--auth-token", True), ("passwd", True), ("db_password_file", True), ("credentials", True),
    ("max_new_tokens", False), ("tokenizer_path", False), ("page_size", False), ("kv_cache_dtype", False), ("", False),
])
def test_what_counts_as_a_secret_name(name, secret):
    assert is_secret_name(name) is secret
