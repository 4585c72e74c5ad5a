"""Where AWS things come from: session, clients, region, role, bucket, and what AWS errors mean.

Resolution order (first that gives a value wins):

* region: `--region`, `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's region in ~/.aws/config;
* role:   `--role`, `PLANNER_SAGEMAKER_ROLE`, `SAGEMAKER_ROLE_ARN`, then (SageMaker Python SDK installed, e.g.
          in SageMaker Studio) `sagemaker.get_execution_role()`;
* bucket: `--bucket`, `PLANNER_S3_URI`, then (SDK installed) `sagemaker.Session().default_bucket()`.

boto3 is imported lazily, the SageMaker SDK only as an optional convenience. Every AWS failure becomes an
`AwsError` (a PlannerError): one line naming the operation, the AWS error code and what to do, which the CLI
prints without a traceback and with exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from planner.errors import PlannerError

ROLE_ENV = ("PLANNER_SAGEMAKER_ROLE", "SAGEMAKER_ROLE_ARN")
BUCKET_ENV = ("PLANNER_S3_URI",)
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
ROLE_ARN_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
# S3 bucket naming rules: 3-63 chars, lowercase letters, digits, dots and hyphens, start/end alphanumeric.
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# botocore retry policy: "adaptive" adds client-side rate limiting on throttling; 10 attempts in total.
# botocore waits 60 s to connect and 60 s for each answer by default; a SageMaker or S3 control call answers in
# about a second, so a silent endpoint is said sooner (planner.aws.pricing has the Price List API's own).
CLIENT_TIMEOUTS: dict[str, float] = {"connect_timeout": 10.0, "read_timeout": 30.0}
RETRY_CONFIG = {"max_attempts": 10, "mode": "adaptive"}
THROTTLING_CODES = {"Throttling", "ThrottlingException", "TooManyRequestsException", "RequestLimitExceeded",
                    "SlowDown", "ProvisionedThroughputExceededException"}
ACCESS_CODES = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnrecognizedClientException",
                "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
                "InvalidAccessKeyId", "AllAccessDisabled"}
PLACEHOLDER_ROLE = "arn:aws:iam::123456789012:role/PLACEHOLDER-SageMakerExecutionRole"
PLACEHOLDER_BUCKET = "s3://placeholder-bucket/planner-probes"


class AwsError(PlannerError):
    """An AWS call failed: operation, error code, AWS's message and a hint, on one line."""

    def __init__(self, operation: str, code: str, message: str, hint: str = ""):
        self.operation, self.code, self.aws_message, self.hint = operation, code, message, hint
        super().__init__(f"aws {operation}", code, hint or message)
        self.args = (self.__str__(),)

    def __str__(self) -> str:
        msg = " ".join(str(self.aws_message).split())
        text = f"AWS {self.operation} failed ({self.code}): {msg}"
        return f"{text}. {self.hint}" if self.hint else text


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str = ""

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def child(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"


def parse_s3_uri(uri: str, field: str = "--bucket") -> S3Location:
    """`s3://bucket[/prefix]` (a bare bucket name is accepted too)."""
    text = (uri or "").strip()
    if not text.startswith("s3://"):
        if "/" in text or ":" in text or not text:
            raise PlannerError(field, uri, "an S3 URI like s3://my-bucket/planner (or a bucket name)")
        text = "s3://" + text
    rest = text[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not BUCKET_RE.match(bucket) or ".." in bucket:
        raise PlannerError(field, uri, "an S3 URI whose bucket is 3-63 lowercase letters, digits, dots or hyphens")
    return S3Location(bucket=bucket, prefix=prefix.strip("/"))


def parse_s3_object(uri: str) -> tuple[str, str]:
    loc = parse_s3_uri(uri, field="s3 uri")
    if not loc.prefix:
        raise PlannerError("s3 uri", uri, "s3://bucket/key")
    return loc.bucket, loc.prefix


def first_env(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def resolve_region(flag: str | None, profile: str | None = None) -> str:
    region = flag or first_env(REGION_ENV)
    if not region:
        with contextlib.suppress(Exception):
            import boto3

            region = boto3.session.Session(profile_name=profile).region_name
    if not region:
        raise PlannerError("--region", None, "an AWS region, e.g. us-east-1 (flag, AWS_REGION or ~/.aws/config)")
    if not re.match(r"^[a-z]{2}(-[a-z]+)+-\d$", region):
        raise PlannerError("--region", region, "an AWS region code like us-east-1")
    return region


def _sdk() -> Any | None:
    try:
        import sagemaker  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - optional extra; any import failure means "not available"
        return None
    return sagemaker


def resolve_role(flag: str | None, *, dry_run: bool = False) -> str:
    role = flag or first_env(ROLE_ENV)
    if not role and not dry_run:
        sdk = _sdk()
        if sdk is not None:
            with contextlib.suppress(Exception):
                role = sdk.get_execution_role()
    if not role:
        if dry_run:
            return PLACEHOLDER_ROLE
        raise PlannerError("--role", None, "an IAM role ARN for SageMaker (arn:aws:iam::<account>:role/<name>) "
                                           f"via --role or {ROLE_ENV[0]}")
    if not ROLE_ARN_RE.match(role):
        raise PlannerError("--role", redact_text(role), "an IAM role ARN: arn:aws:iam::<12-digit account>:role/<name>")
    return role


def resolve_bucket(flag: str | None, *, region: str | None = None, dry_run: bool = False) -> S3Location:
    uri = flag or first_env(BUCKET_ENV)
    if not uri and not dry_run:
        sdk = _sdk()
        if sdk is not None:
            with contextlib.suppress(Exception):
                import boto3

                sess = sdk.Session(boto_session=boto3.session.Session(region_name=region))
                uri = f"s3://{sess.default_bucket()}/planner-probes"
    if not uri:
        if dry_run:
            uri = PLACEHOLDER_BUCKET
        else:
            raise PlannerError("--bucket", None, f"an S3 URI for probe code and outputs, e.g. s3://my-bucket/planner "
                                                 f"(flag or {BUCKET_ENV[0]})")
    loc = parse_s3_uri(uri)
    return loc if loc.prefix else S3Location(loc.bucket, "planner-probes")


def redact_text(text: str) -> str:
    """12-digit account ids in ARNs, ECR hosts and default-bucket names become ************."""
    return re.sub(r"(?<!\d)\d{12}(?!\d)", "*" * 12, text)


class Aws:
    """A boto3 session and the clients made from it (retries: adaptive)."""

    def __init__(self, region: str, profile: str | None = None):
        import boto3

        self.region = region
        try:
            self.session = boto3.session.Session(profile_name=profile, region_name=region)
        except Exception as exc:  # botocore ProfileNotFound and friends
            raise PlannerError("--profile", profile, f"a profile in ~/.aws/config ({exc})") from None
        self._clients: dict[str, Any] = {}

    def client(self, service: str) -> Any:
        if service not in self._clients:
            from botocore.config import Config

            self._clients[service] = self.session.client(service, config=Config(retries=RETRY_CONFIG, **CLIENT_TIMEOUTS))
        return self._clients[service]

    @property
    def sagemaker(self) -> Any:
        return self.client("sagemaker")

    @property
    def s3(self) -> Any:
        return self.client("s3")


def translate(exc: BaseException, operation: str) -> PlannerError | None:
    """An AwsError for botocore's exceptions; None for anything else."""
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover
        return None
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError | bx.CredentialRetrievalError):
        return AwsError(operation, "NoCredentials", str(exc),
                        "configure credentials: `aws configure`, AWS_PROFILE, or an instance/Studio role")
    if isinstance(exc, bx.NoRegionError):
        return AwsError(operation, "NoRegion", str(exc), "pass --region or set AWS_REGION")
    if isinstance(exc, bx.ProfileNotFound):
        return AwsError(operation, "ProfileNotFound", str(exc), "check AWS_PROFILE / --profile")
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ReadTimeoutError):
        return AwsError(operation, "ConnectionError", str(exc), "check the network and the region")
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "ClientError"))
        message = redact_text(str(err.get("Message", exc)))
        if code in ACCESS_CODES:
            hint = "the credentials or the role lack a permission for this call (see the IAM policy)"
        elif code in THROTTLING_CODES:
            hint = "AWS is throttling requests even after retries; wait a minute and run the command again"
        elif code == "ResourceLimitExceeded":
            hint = "a SageMaker quota is reached; request an increase in Service Quotas or pick another instance"
        elif code in ("NoSuchBucket", "404", "NotFound"):
            hint = "check the bucket/key and region"
        else:
            hint = ""
        return AwsError(operation, code, message, hint)
    if isinstance(exc, bx.BotoCoreError):
        return AwsError(operation, type(exc).__name__, redact_text(str(exc)))
    return None


@contextlib.contextmanager
def aws_errors(operation: str) -> Iterator[None]:
    """Turn botocore exceptions raised inside into one-line AwsErrors."""
    try:
        yield
    except PlannerError:
        raise
    except Exception as exc:
        translated = translate(exc, operation)
        if translated is None:
            raise
        raise translated from None


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ClientError (None otherwise)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


def no_such_job(sagemaker: Any, exc: BaseException, name: str) -> bool:
    """Whether DescribeTrainingJob's error means "no job called `name`", without trusting its wording.

    SageMaker answers ValidationException ("Requested resource not found"), a compatible endpoint (moto)
    "Could not find training job ...": the message names the job in both, and the name is the call's only
    input, so a ValidationException naming the job is taken as not-found. When the message does not name it,
    ListTrainingJobs(NameContains=name) decides (an exact name match means the job exists after all).
    """
    code = error_code(exc)
    if code in ("ResourceNotFound", "ResourceNotFoundException"):
        return True
    if code != "ValidationException":
        return False
    message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", ""))
    if name in message:
        return True
    listed = sagemaker.list_training_jobs(NameContains=name, MaxResults=100).get("TrainingJobSummaries", [])
    return not any(job.get("TrainingJobName") == name for job in listed)

