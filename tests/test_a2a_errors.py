"""retrysafe's A2A errors in the shapes of A2A v1.0 and v0.3, and as the a2a-sdk gives them.

``error_info`` describes each refusal once; an a2a-sdk error class raised with
its metadata must give the same ErrorInfo, so that the ASGI middleware and code
that raises the SDK's errors answer alike.
"""

from __future__ import annotations

from typing import Any

import pytest
from a2a.utils.error_handlers import build_error_details
from a2a.utils.errors import (
    A2A_ERROR_REASONS,
    JSON_RPC_ERROR_CODE_MAP,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
)

from retrysafe._protocols.a2a import (
    A2AErrorInfo,
    error_info,
    failed_finally,
    invalid_request,
)
from retrysafe.errors import (
    AmbiguousCredentialsError,
    FingerprintMismatchError,
    IdempotencyError,
    InProgressError,
    InvalidKeyError,
    PrincipalRequiredError,
    SecretError,
    StoreUnavailableError,
)

SDK_CLASS = {-32603: InternalError, -32602: InvalidParamsError, -32600: InvalidRequestError}

REFUSALS: list[tuple[IdempotencyError, int, dict[str, str]]] = [
    (
        InProgressError("busy", retry_after=2.2, original_request_id="7"),
        -32603,
        {
            "code": "idempotency_in_flight",
            "retryable": "true",
            "retryAfter": "3",
            "originalRequestId": "7",
        },
    ),
    (
        FingerprintMismatchError("other", original_fingerprint="ab" * 32, original_request_id="7"),
        -32602,
        {
            "code": "idempotency_conflict",
            "retryable": "false",
            "originalRequestId": "7",
            "originalFingerprint": "ab" * 32,
        },
    ),
    (
        StoreUnavailableError("down", retry_after=0.1),
        -32603,
        {"code": "idempotency_store_unavailable", "retryable": "true", "retryAfter": "1"},
    ),
    (
        InvalidKeyError("params.message.messageId is required"),
        -32602,
        {"code": "idempotency_key_invalid", "retryable": "false"},
    ),
    (
        PrincipalRequiredError("no credential"),
        -32600,
        {"code": "idempotency_principal_required", "retryable": "false"},
    ),
    (
        AmbiguousCredentialsError("two Authorization lines"),
        -32600,
        {"code": "idempotency_credentials_ambiguous", "retryable": "false"},
    ),
]


def infos() -> list[A2AErrorInfo]:
    return [
        *(error_info(exc) for exc, *_ in REFUSALS),
        failed_finally(),
        invalid_request("idempotency_batch_unsupported", "no batches"),
    ]


@pytest.mark.parametrize(("exc", "code", "metadata"), REFUSALS)
def test_each_refusal_has_one_description(
    exc: IdempotencyError, code: int, metadata: dict[str, str]
) -> None:
    info = error_info(exc)
    assert (info.code, info.metadata) == (code, metadata)
    assert info.reason == A2A_ERROR_REASONS[SDK_CLASS[code]]
    assert JSON_RPC_ERROR_CODE_MAP[SDK_CLASS[code]] == code


@pytest.mark.parametrize("info", infos(), ids=lambda i: i.metadata["code"])
def test_the_v10_data_is_what_the_sdk_gives_for_its_own_error(info: A2AErrorInfo) -> None:
    """ErrorInfo first, equal to the SDK's for its class raised with the metadata."""
    details = info.details()
    sdk = build_error_details(SDK_CLASS[info.code](info.message, data=info.metadata))
    assert details[0] == sdk[0]
    assert all("@type" in d for d in details)
    assert all(isinstance(v, str) for v in info.metadata.values())  # map<string, string>
    retry = [d for d in details if d["@type"].endswith("google.rpc.RetryInfo")]
    if "retryAfter" in info.metadata:
        assert retry == [
            {
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": info.metadata["retryAfter"] + "s",
            }
        ]
    else:
        assert retry == []
    reply = info.reply(5)
    assert reply == {
        "jsonrpc": "2.0",
        "id": 5,
        "error": {"code": info.code, "message": info.message, "data": details},
    }


def test_an_invalid_message_id_names_the_field() -> None:
    details = error_info(InvalidKeyError("idempotency key is empty")).details()
    assert details[1] == {
        "@type": "type.googleapis.com/google.rpc.BadRequest",
        "fieldViolations": [
            {"field": "message.messageId", "description": "idempotency key is empty"}
        ],
    }


def test_the_v03_data_keeps_the_keys_of_before() -> None:
    exc = InProgressError("busy", retry_after=2.2, original_request_id="7")
    assert error_info(exc).reply(1, "0.3")["error"]["data"] == {
        "code": "idempotency_in_flight",
        "retryable": True,
        "retry_after": 3,
        "original_request_id": "7",
    }
    conflict = FingerprintMismatchError("x", original_fingerprint="f", original_request_id="2")
    assert error_info(conflict).legacy_data() == {
        "code": "idempotency_conflict",
        "retryable": False,
        "original_request_id": "2",
        "original_fingerprint": "f",
    }


def test_an_error_without_an_a2a_answer_is_raised() -> None:
    exc: Any = SecretError("no secret")
    with pytest.raises(SecretError) as raised:
        error_info(exc)
    assert raised.value is exc
