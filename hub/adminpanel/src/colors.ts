/** A stable colour per owner, so that one person's shares look alike on every GPU of the map. */

export function ownerColor(owner: string): string {
  let hash = 0;
  for (let i = 0; i < owner.length; i++) {
    hash = (hash * 31 + owner.charCodeAt(i)) | 0;
  }
  return `hsl(${Math.abs(hash) % 360}, 60%, 55%)`;
}
