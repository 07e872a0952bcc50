"""Where the published profiles are: `shared/profiles` beside the repository (as in CI and on
the developers' machines), or wherever DAPPLE_PROFILES points."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = os.environ.get("DAPPLE_PROFILES",
                          os.path.join(os.path.dirname(REPO), "shared", "profiles"))


def published_profile(relative: str) -> str:
    path = os.path.join(PROFILES, relative)
    if not os.path.exists(path):
        raise FileNotFoundError(f"published profile {path} not found: put shared/ beside the "
                                f"repository or set DAPPLE_PROFILES to its profiles folder")
    return path
