"""No credential is recorded in run.json or printed: storage options at any depth, URLs with
userinfo or signed query strings, messages and log lines that carry them."""

import json
import logging

from pipeline.core.redact import REDACTED, recordable_options, redact_text, redact_url, usable_recorded_options

SECRETS = ("AKIDSECRET", "hunter2", "s3cr3t-value", "AccountKey=abc123", "Bearer tok3n", "sig-value",
           "c2lnbmF0dXJl", "sessiontok")


def test_nested_storage_options_keep_only_harmless_values():
    options = {
        "key": "AKIDSECRET", "secret": "hunter2", "anon": False,
        "client_kwargs": {"endpoint_url": "https://AKIDSECRET:hunter2@minio.internal:9000/",
                          "region_name": "eu-west-1", "aws_secret_access_key": "s3cr3t-value",
                          "aws_session_token": "sessiontok"},
        "config_kwargs": {"retries": {"max_attempts": 10, "mode": "adaptive"}, "connect_timeout": 5},
        "connection_string": "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=abc123",
        "headers": {"Authorization": "Bearer tok3n"},
        "auth": ["user", "hunter2"],
        "passwd": "hunter2",
        "s3_additional_kwargs": {"SSECustomerKey": "s3cr3t-value"},
    }
    recorded = recordable_options(options)
    assert recorded == {
        "key": REDACTED, "secret": REDACTED, "anon": False,
        "client_kwargs": {"endpoint_url": "https://minio.internal:9000/", "region_name": "eu-west-1",
                          "aws_secret_access_key": REDACTED, "aws_session_token": REDACTED},
        "config_kwargs": {"retries": {"max_attempts": 10, "mode": "adaptive"}, "connect_timeout": 5},
        "connection_string": REDACTED, "headers": REDACTED, "auth": REDACTED, "passwd": REDACTED,
        "s3_additional_kwargs": REDACTED,
    }
    text = json.dumps(recorded)
    assert not [secret for secret in SECRETS if secret in text]


def test_an_unknown_option_is_redacted_whatever_its_name():
    assert recordable_options({"my_plugin_value": "anything", "profile": "prod"}) == \
        {"my_plugin_value": REDACTED, "profile": REDACTED}
    assert recordable_options({"client_kwargs": ["not", "a", "table"]}) == {"client_kwargs": REDACTED}


def test_recorded_options_reach_the_same_store_without_the_redacted_values():
    recorded = recordable_options({"key": "AKIDSECRET", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000",
                                                                          "aws_secret_access_key": "x"}})
    assert usable_recorded_options(recorded) == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}


def test_urls_lose_userinfo_and_signing_parameters():
    assert redact_url("s3://AKIDSECRET:hunter2@bucket/in/") == "s3://bucket/in/"
    assert redact_url("https://user@host.example/path") == "https://host.example/path"
    signed = ("https://bucket.s3.amazonaws.com/in/a.parquet?versionId=3&X-Amz-Algorithm=AWS4-HMAC-SHA256"
              "&X-Amz-Credential=AKIDSECRET%2F20261201&X-Amz-Signature=c2lnbmF0dXJl&X-Amz-Security-Token=sessiontok")
    assert redact_url(signed) == "https://bucket.s3.amazonaws.com/in/a.parquet?versionId=3&X-Amz-Algorithm=AWS4-HMAC-SHA256"
    azure = "https://acct.blob.core.windows.net/c/in?sv=2022-11-02&sp=r&sig=sig-value"
    assert redact_url(azure) == "https://acct.blob.core.windows.net/c/in?sv=2022-11-02&sp=r"
    assert redact_url("data/in/part-0.parquet") == "data/in/part-0.parquet"
    assert redact_url("s3://bucket/dt=2026-12-01/") == "s3://bucket/dt=2026-12-01/"


def test_messages_lose_the_credentials_of_every_url_in_them():
    message = ("cannot list input 's3://AKIDSECRET:hunter2@bucket/in/': Could not connect to "
               "'https://u:hunter2@minio:9000/bucket?list-type=2&X-Amz-Signature=c2lnbmF0dXJl'")
    redacted = redact_text(message)
    assert redacted == ("cannot list input 's3://bucket/in/': Could not connect to "
                        "'https://minio:9000/bucket?list-type=2'")


def test_log_lines_are_redacted(capsys):
    from pipeline.core.logs import configure_logging

    configure_logging(logging.INFO)
    logging.getLogger("pipeline.test").warning("retrying s3://AKIDSECRET:hunter2@bucket/in/part-0.parquet")
    assert capsys.readouterr().err == "retrying s3://bucket/in/part-0.parquet\n"


def test_the_recorded_config_holds_no_credential(tmp_path):
    from pipeline.offline.config import RunConfig
    from pipeline.offline.manifest import recorded_config

    config = RunConfig.of(input=("s3://AKIDSECRET:hunter2@bucket/in/",), output=str(tmp_path / "out"),
                          reuse="s3://AKIDSECRET:hunter2@bucket/yesterday/",
                          storage_options={"client_kwargs": {"aws_secret_access_key": "s3cr3t-value",
                                                          "endpoint_url": "http://127.0.0.1:9000"}})
    recorded = recorded_config(config)
    assert recorded["input"] == ["s3://bucket/in/"] and recorded["reuse"] == "s3://bucket/yesterday/"
    assert recorded["storage_options"] == {"client_kwargs": {"aws_secret_access_key": REDACTED,
                                                             "endpoint_url": "http://127.0.0.1:9000"}}
    assert not [secret for secret in SECRETS if secret in json.dumps(recorded)]
