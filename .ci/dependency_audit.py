"""CI's dependency audit: pip-audit over the virtualenv, read as JSON.

Fails (exit 1) on a known vulnerability in an installed package. When the vulnerability
database cannot be reached, or answers for none of the packages (a package index mirror
without the vulnerability API answers "not found" for every one), the audit did not
happen: it says so plainly and exits 0, so that CI on an offline machine is not red for
a check it could not make. Usage: python .ci/dependency_audit.py PIP_AUDIT_EXECUTABLE
"""

from __future__ import annotations

import json
import subprocess  # nosec B404
import sys


def main(pip_audit: str) -> int:
    done = subprocess.run(  # nosec B603
        [pip_audit, "--progress-spinner", "off", "--skip-editable", "--format", "json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    try:
        report = json.loads(done.stdout)
    except ValueError:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"dependency audit NOT RUN: the vulnerability database is unreachable ({reason})")
        return 0
    packages = report.get("dependencies", [])
    audited = [p for p in packages if "skip_reason" not in p]
    vulnerable = [p for p in audited if p.get("vulns")]
    for package in vulnerable:
        for vuln in package["vulns"]:
            fixed = ", ".join(vuln.get("fix_versions", [])) or "no fixed release"
            print(f"VULNERABLE {package['name']} {package['version']}: {vuln['id']} ({fixed})")
    if vulnerable:
        return 1
    if not audited:
        print(
            f"dependency audit NOT RUN: the vulnerability database answered for none of the "
            f"{len(packages)} installed packages (this machine's package index has no "
            "vulnerability data)"
        )
        return 0
    skipped = len(packages) - len(audited)
    print(f"dependency audit: {len(audited)} packages, no known vulnerabilities"
          + (f" ({skipped} could not be audited)" if skipped else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
