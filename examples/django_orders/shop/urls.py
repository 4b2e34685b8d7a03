from django.urls import path
from orders import views

urlpatterns = [
    path("orders", views.create_order),
    path("orders/<str:cart_mandate_id>", views.order_count),
]
