// RUN: hspmd-opt %s --load-pass %S/../../examples/passes/fuse_silu.py -p fuse-silu | filecheck %s

// The tutorial pass of docs/your-own-pass.md: x * sigmoid(x), in either order, becomes one
// graph.silu(x); the sigmoid goes with it unless something else reads it; x * sigmoid(y) stays.

builtin.module {
  func.func @train_step() {
    %x = graph.input "x" : tensor<4x8xf32>
    %y = graph.input "y" : tensor<4x8xf32>
    %s = graph.sigmoid %x : (tensor<4x8xf32>) -> tensor<4x8xf32>
    %a = graph.mul %x, %s : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
    %t = graph.sigmoid %a : (tensor<4x8xf32>) -> tensor<4x8xf32>
    %b = graph.mul %t, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
    %u = graph.sigmoid %y : (tensor<4x8xf32>) -> tensor<4x8xf32>
    %c = graph.mul %b, %u : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
    %d = graph.mul %y, %u : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
    graph.output "c", %c : tensor<4x8xf32>
    graph.output "d", %d : tensor<4x8xf32>
    func.return
  }
}

// CHECK:      %[[X:.*]] = graph.input "x"
// CHECK-NEXT: %[[Y:.*]] = graph.input "y"
// CHECK-NEXT: %[[A:.*]] = graph.silu %[[X]] : (tensor<4x8xf32>) -> tensor<4x8xf32>
// CHECK-NEXT: %[[B:.*]] = graph.silu %[[A]] : (tensor<4x8xf32>) -> tensor<4x8xf32>
// CHECK-NEXT: %[[U:.*]] = graph.sigmoid %[[Y]]
// CHECK-NEXT: %[[C:.*]] = graph.mul %[[B]], %[[U]]
// CHECK-NEXT: %[[D:.*]] = graph.silu %[[Y]]
// CHECK-NEXT: graph.output "c", %[[C]]
// CHECK-NEXT: graph.output "d", %[[D]]
// CHECK-NOT:  graph.sigmoid
